"""The fused Triton kernels against the plain-torch chains they replace: on the GPU, or in Triton's interpreter on
the CPU (conftest); skipped without Triton."""

from __future__ import annotations

import pytest
import torch

from omnistage.layers import triton_norm, triton_ops
from omnistage.layers.norm import rms_norm_reference
from omnistage.layers.rotary import RotaryEmbedding, apply_rotary_emb
from omnistage.layers.sampling import exponential_noise
from omnistage.models.qwen3_omni.code2wav_conv import SnakeBeta

from conftest import KERNEL_DEVICE as DEV

pytestmark = pytest.mark.skipif(triton_ops.triton is None, reason="needs Triton")


# NOTE: the interpreter truncates fp32 -> bf16 where the GPU rounds to nearest: there every kernel is off by up to
# a bf16 step in most values, so only the GPU run checks how many values match exactly.
EXACT = DEV == "cuda"
DTYPE = torch.bfloat16 if EXACT else torch.float32


def ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference in units of b's bf16 spacing."""
    spacing = torch.finfo(torch.bfloat16).eps * b.float().abs().clamp(min=1e-3)
    return float(((a.float() - b.float()).abs() / spacing).max())


@pytest.mark.parametrize("rows,d", [(1, 1024), (37, 2048), (64, 128), (5, 96)])
def test_rms_norm_matches_torch(rows: int, d: int) -> None:
    g = torch.Generator(DEV).manual_seed(rows)
    x = torch.randn(rows, d, device=DEV, generator=g).to(DTYPE) * 3
    w = (1 + 0.1 * torch.randn(d, device=DEV, generator=g)).to(DTYPE)
    fused, ref = triton_norm.rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6)
    assert not EXACT or (fused != ref).float().mean() < 0.02  # only the sum order differs
    assert ulps(fused, ref) <= 2


@pytest.mark.parametrize("mrope", [None, (24, 20, 20)])
def test_rms_norm_rope_matches_torch(mrope) -> None:
    t, heads, d = 19, 16, 128
    g = torch.Generator(DEV).manual_seed(0)
    x = torch.randn(t, heads, d, device=DEV, generator=g).to(DTYPE)
    w = (1 + 0.1 * torch.randn(d, device=DEV, generator=g)).to(DTYPE)
    rope = RotaryEmbedding(d, 1e6, mrope).to(DEV)
    pos = torch.arange(100, 100 + t, device=DEV)
    cos, sin = rope(pos if mrope is None else pos.expand(3, t), DTYPE)
    fused = triton_norm.rms_norm(x, w, 1e-6, cos, sin)
    ref = apply_rotary_emb(rms_norm_reference(x, w, 1e-6), cos, sin)
    assert fused.shape == ref.shape
    # NOTE: Triton's fp32 division and sum order move some values by one bf16 step; an indexing bug moves
    # them by O(1)
    assert float((fused.float() - ref.float()).abs().max()) <= float(ref.float().abs().max()) * 2 ** -7
    assert not EXACT or (fused != ref).float().mean() < 0.2


@pytest.mark.parametrize("folded", [False, True])
def test_snake_beta_matches_torch(folded: bool) -> None:
    """Plain, and as the fused decoder runs it: a strided input (a trimmed transposed-conv output) plus the conv's
    bias, written after the context columns of the next conv's input buffer."""
    m = SnakeBeta(96).to(DEV).to(DTYPE)
    with torch.no_grad():
        m.alpha.normal_(0, 0.5)
        m.beta.normal_(0, 0.5)
    full = torch.randn(3, 96, 2060, device=DEV).to(DTYPE) * 4
    x = full[..., 5:2056] if folded else full[..., :2051].contiguous()
    bias = (torch.randn(96, device=DEV) * 2).to(DTYPE) if folded else None
    buf = torch.full((3, 96, 2057), 7.0, device=DEV, dtype=DTYPE)
    fused = triton_ops.snake_beta(x, m.alpha.detach(), m.beta.detach(), bias, out=buf[..., 6:] if folded else None)
    with torch.no_grad():
        ref = m(x if bias is None else x + bias[:, None])
    assert fused.data_ptr() == buf[..., 6:].data_ptr() if folded else fused.is_contiguous()
    assert float((fused.float() - ref.float()).abs().max()) <= float(ref.float().abs().max()) * 2 ** -7
    assert not EXACT or (fused != ref).float().mean() < 0.2
    assert not folded or bool((buf[..., :6] == 7).all())


def test_race_argmax_draws_what_the_reference_draws() -> None:
    g = torch.Generator(DEV).manual_seed(1)
    b, vocab = 64, 3072
    scores = torch.randn(b, vocab, device=DEV, generator=g) * 3
    scores[::3, 50:] = float("-inf")  # truncated rows keep 50 ids
    seeds = torch.randint(0, 2 ** 62, (b,), device=DEV, generator=g)
    steps = torch.randint(0, 10 ** 6, (b,), device=DEV, generator=g)
    fused = triton_ops.race_argmax(scores, seeds, steps)
    ref = (scores - exponential_noise(seeds, steps, vocab).log()).argmax(-1)
    assert torch.equal(fused, ref)
    assert len(set(fused.tolist())) > b // 2  # draws, not one id
