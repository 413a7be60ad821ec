"""The code predictor's RoPE tables: positions 0..G-1 computed once (`allocate_cache`, model dtype), every pass
reading views of them (no RoPE kernels per pass) that hold exactly what `RotaryEmbedding` gives for the pass's
positions; on the fast path (Triton's interpreter on the CPU, conftest) the fused q/k norm reads them in place."""

from __future__ import annotations

import pytest
import torch
from conftest import KERNEL_DEVICE as DEV

from omnistage.layers import triton_norm, triton_ops
from omnistage.models.qwen3_omni.code_predictor import CodePredictor
from omnistage.models.qwen3_omni.decoder import fuse_projections
from omnistage.models.qwen3_omni.presets import preset_config


def _predictor(preset: str, groups: int, dtype: torch.dtype, max_rows: int) -> CodePredictor:
    cfg = dict(preset_config(preset)["talker_config"]["code_predictor_config"], num_code_groups=groups)
    torch.manual_seed(groups)
    cp = CodePredictor(cfg).eval().requires_grad_(False).to(DEV, dtype)
    cp.allocate_cache(max_rows)
    return cp


@pytest.mark.parametrize("groups,dtype", [(16, torch.float32), (16, torch.bfloat16), (5, torch.float32)])
def test_pass_tables_are_views_holding_the_per_pass_values(preset: str, groups: int, dtype: torch.dtype) -> None:
    cp = _predictor(preset, groups, dtype, max_rows=6)
    tables = {t.untyped_storage().data_ptr() for t in (*cp._rope, *cp._prefill_rope)}
    for rows in (1, 4, 6):
        for pos, n in [(0, 2), *((p, 1) for p in range(2, groups))]:
            cos, sin = cp._rope_rows(pos, n, rows)
            want = cp.model.rotary_emb(torch.arange(pos, pos + n, device=DEV).repeat(rows), dtype)
            assert torch.equal(cos, want[0]) and torch.equal(sin, want[1]) and cos.dtype == dtype
            assert {cos.untyped_storage().data_ptr(), sin.untyped_storage().data_ptr()} <= tables
    with pytest.raises(ValueError):
        cp._rope_rows(2, 2, 1)


@pytest.mark.skipif(triton_ops.triton is None, reason="needs Triton")
@torch.no_grad()
@pytest.mark.parametrize("fused", [False, True])
def test_passes_run_no_rope_and_the_kernel_reads_the_tables(preset: str, fused: bool, monkeypatch) -> None:
    cp, rows = _predictor(preset, 16, torch.float32, max_rows=4), 3
    if fused:
        fuse_projections(cp)
    x = torch.randn(rows * 3, cp.model.config.hidden_size, generator=torch.Generator().manual_seed(0)).to(DEV)
    want = cp._pass(x[:2 * rows], 0, rows), cp._pass(x[2 * rows:], 5, rows)

    def no_rope(*args):
        raise AssertionError("RotaryEmbedding ran in a pass")

    monkeypatch.setattr(cp.model.rotary_emb, "forward", no_rope)
    launched, kernel = [], triton_norm._rms_norm_rope_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                if kwargs["ROPE"]:
                    launched.append((args[3].data_ptr(), args[12]))  # cos, its row stride
                return kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(triton_norm, "_rms_norm_rope_kernel", Spy())
    monkeypatch.setattr(triton_ops, "fast_path", lambda t: True)
    got = cp._pass(x[:2 * rows], 0, rows), cp._pass(x[2 * rows:], 5, rows)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6)
    layers = len(cp.model.layers)
    norms_per_pass = layers * (1 if fused else 2)  # q and k normed in one launch once q/k/v are merged
    half = cp.model.config.head_dim // 2
    prefill, decode = (cp._prefill_rope[0].data_ptr(), half), (cp._rope[0][5].data_ptr(), 0)
    assert launched == [prefill] * norms_per_pass + [decode] * norms_per_pass
