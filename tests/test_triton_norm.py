"""The RMSNorm kernels of `layers.triton_norm` against the eager chains they replace: on the GPU, or in Triton's
interpreter on the CPU (conftest: fp32 there, bf16 with exactness checks on the GPU); skipped without Triton."""

from __future__ import annotations

import pytest
import torch
from conftest import KERNEL_DEVICE as DEV

from omnistage.layers import norm, triton_norm, triton_ops
from omnistage.layers.norm import rms_norm_reference
from omnistage.layers.rotary import apply_rotary_emb

pytestmark = pytest.mark.skipif(triton_ops.triton is None, reason="needs Triton")

EXACT = DEV == "cuda"  # NOTE: the interpreter truncates fp32 -> bf16 (test_triton_ops.py): bits on the GPU
DTYPE = torch.bfloat16 if EXACT else torch.float32


def spy_launches(monkeypatch, name: str) -> list[tuple[torch.Tensor, ...]]:
    """The tensor arguments of every launch of the kernel `triton_norm.name`."""
    kernel, seen = getattr(triton_norm, name), []

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.append(tuple(a for a in args if isinstance(a, torch.Tensor)))
                return kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(triton_norm, name, Spy())
    return seen


@pytest.mark.parametrize("rows,n", [(1, 1024), (37, 2048), (5, 96), (16, 1000)])
def test_add_rms_norm_matches_eager(rows: int, n: int, monkeypatch) -> None:
    g = torch.Generator(DEV).manual_seed(n)
    wide = (torch.randn(2, rows, n + 5, device=DEV, generator=g) * 3).to(DTYPE)
    x, residual = wide[0, :, 2:2 + n], wide[1, :, :n]  # strided rows, read in place
    w = (1 + 0.1 * torch.randn(n, device=DEV, generator=g)).to(DTYPE)
    launched = spy_launches(monkeypatch, "_add_rms_norm_kernel")
    normed, total = triton_norm.add_rms_norm(x, residual, w, 1e-6)
    assert [t.data_ptr() for t in launched[0][:2]] == [x.data_ptr(), residual.data_ptr()] and len(launched) == 1
    assert torch.equal(total, residual + x)  # the add rounds to the dtype first, as eager
    ref = rms_norm_reference(residual + x, w, 1e-6)
    assert normed.shape == ref.shape == total.shape and normed.is_contiguous()
    if EXACT:
        assert (normed != ref).float().mean() < 0.02  # only the order of the sum of squares differs
        assert float((normed.float() - ref.float()).abs().max()) <= float(ref.float().abs().max()) * 2 ** -7
    else:
        torch.testing.assert_close(normed, ref, rtol=2e-6, atol=2e-6)


def test_add_rms_norm_path_choice(monkeypatch) -> None:
    g = torch.Generator(DEV).manual_seed(0)
    x, residual, w = (torch.randn(3, 64, device=DEV, generator=g).to(DTYPE) for _ in range(3))
    normed, stream = norm.add_rms_norm(x, None, w[0], 1e-6)  # the first norm: no add, `x` is the stream
    assert stream is x and torch.equal(normed, norm.rms_norm(x, w[0], 1e-6))
    launched, outs = spy_launches(monkeypatch, "_add_rms_norm_kernel"), []
    for fast in (False, True):
        monkeypatch.setattr(triton_ops, "fast_path", lambda t, fast=fast: fast)
        outs.append(norm.add_rms_norm(x, residual, w[0], 1e-6))
    assert len(launched) == 1  # the kernel on the fast path only
    (eager, eager_sum), (fused, fused_sum) = outs
    assert torch.equal(eager, rms_norm_reference(residual + x, w[0], 1e-6)) and torch.equal(eager_sum, residual + x)
    assert torch.equal(fused_sum, eager_sum)
    torch.testing.assert_close(fused, eager, rtol=1e-2 if EXACT else 2e-6, atol=2e-6)


@pytest.mark.parametrize("rows,n_pos", [(5, 1), (4, 2)])
def test_rms_norm_qk_reads_shared_rope_tables_in_place(rows: int, n_pos: int, monkeypatch) -> None:
    """The code predictor's tables: one position's row for every token (stride 0), or the prefill's rows."""
    g = torch.Generator(DEV).manual_seed(rows)
    heads, kv_heads, d = 4, 2, 32
    qk = torch.randn(rows * n_pos, heads + 2 * kv_heads, d, device=DEV, generator=g).to(DTYPE)[:, :heads + kv_heads]
    qw, kw = ((1 + 0.2 * torch.randn(d, device=DEV, generator=g)).to(DTYPE) for _ in range(2))
    table = torch.randn(2, 16, d // 2, device=DEV, generator=g).to(DTYPE)
    if n_pos == 1:
        cos, sin = table[0, 7].expand(rows, -1), table[1, 7].expand(rows, -1)
    else:
        cos, sin = table[:, 3:5].repeat(1, rows, 1)
    launched = spy_launches(monkeypatch, "_rms_norm_rope_kernel")
    q, k = triton_norm.rms_norm_qk(qk, qw, kw, heads, 1e-6, cos, sin)
    assert [t.data_ptr() for t in launched[0][3:5]] == [cos.data_ptr(), sin.data_ptr()]  # no copy
    want = triton_norm.rms_norm_qk(qk, qw, kw, heads, 1e-6, cos.contiguous(), sin.contiguous())
    assert torch.equal(q, want[0]) and torch.equal(k, want[1])
    for out, part, weight in ((q, qk[:, :heads], qw), (k, qk[:, heads:], kw)):
        ref = apply_rotary_emb(rms_norm_reference(part, weight, 1e-6), cos, sin)
        assert float((out.float() - ref.float()).abs().max()) <= float(ref.float().abs().max()) * (
            2 ** -7 if EXACT else 1e-6)
