"""The fused decode MoE (layers.triton_fused_moe) against the reference expert loop and the grouped-GEMM
path: in Triton's interpreter on the CPU (fp32, small shapes), on the GPU in bf16 at the real shapes too."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from omnistage.layers import moe, triton_fused_moe, triton_moe, triton_ops

from conftest import KERNEL_DEVICE as DEV
from test_triton_moe import DTYPE, EXACT, cuda_only, moe_case, rel, skewed_ids

pytestmark = pytest.mark.skipif(triton_ops.triton is None, reason="needs Triton")
TOL = 2e-2 if EXACT else 1e-5


def reference(x, w13, w2, weights, ids) -> torch.Tensor:
    return moe.fused_experts_reference(x.float(), w13.float(), w2.float(), weights.float(), ids)


def error(x, w13, w2, weights, ids) -> float:
    return rel(triton_fused_moe.fused_moe(x, w13, w2, weights, ids), reference(x, w13, w2, weights, ids))


def with_ids(case: tuple, ids: torch.Tensor) -> tuple:
    x, w13, w2, _, _ = case
    g = torch.Generator(DEV).manual_seed(ids.numel())
    weights = torch.rand(ids.shape, device=DEV, generator=g)
    return x, w13, w2, (weights / weights.sum(1, keepdim=True)).to(DTYPE), ids


@pytest.mark.parametrize("t,k,h,i", [(1, 2, 64, 32), (3, 4, 64, 32), (7, 3, 64, 32), (16, 2, 64, 32),
                                     (20, 4, 64, 32), (13, 3, 256, 160), (5, 4, 80, 48)])
def test_fused_moe_matches_reference(t: int, k: int, h: int, i: int) -> None:
    assert error(*moe_case(t=t, h=h, e=8, i=i, k=k)) < TOL


def test_empty_experts_and_one_expert_in_every_row() -> None:
    e, k = 8, 3
    case = moe_case(t=40, h=64, e=e, i=32, k=k)
    ids = skewed_ids(40, e, k, seed=1)  # expert 0: 40 rows (3 blocks); experts 6, 7: none
    counts = torch.bincount(ids.flatten(), minlength=e)
    assert counts[0] == 40 and (counts[6:] == 0).all()
    assert error(*with_ids(case, ids)) < TOL


@pytest.mark.parametrize("t,k", [(20, 2), (34, 4)])
def test_blocks_fill_the_fixed_grid(t: int, k: int) -> None:
    e = 8
    ids = (torch.arange(t, device=DEV)[:, None] % 2) * (e // 2) + torch.arange(k, device=DEV)
    counts = torch.bincount(ids.flatten(), minlength=e)
    needed = int(((counts + triton_fused_moe.BLOCK_M - 1) // triton_fused_moe.BLOCK_M).sum())
    assert (needed, triton_fused_moe.max_blocks(t * k, e)) == {20: (4, 11), 34: (16, 17)}[t]
    assert error(*with_ids(moe_case(t=t, h=64, e=e, i=32, k=k), ids)) < TOL


def test_expert_gemm_rows_match_an_expert_loop() -> None:
    e, k, i = 8, 3, 48
    x, w13, w2, _, ids = moe_case(t=19, h=64, e=e, i=i, k=k)
    token, _, offs = triton_moe.moe_align(ids, e)
    act = triton_fused_moe.expert_gemm(x, w13, token, offs, gated=True)
    y = triton_fused_moe.expert_gemm(act, w2, token, offs, gated=False)
    bounds = [0] + offs.tolist()
    for ex in range(e):
        rows = slice(bounds[ex], bounds[ex + 1])
        gate, up = F.linear(x[token[rows]].float(), w13[ex].float()).chunk(2, dim=-1)
        assert rel(act[rows], F.silu(gate) * up) < TOL
        assert rel(y[rows], F.linear(act[rows].float(), w2[ex].float())) < TOL
    assert act.shape == (19 * k, i) and y.shape == x.repeat(k, 1).shape


@pytest.mark.parametrize("slots,dtype,path", [(512, torch.bfloat16, "fused"), (520, torch.bfloat16, "other"),
                                              (64, torch.float32, "other")])
def test_dispatch_takes_fused_moe_for_decode_sizes(slots: int, dtype: torch.dtype, path: str,
                                                   monkeypatch) -> None:
    monkeypatch.setattr(moe, "fast_path", lambda x: True)
    monkeypatch.setattr(triton_fused_moe, "fused_moe", lambda *a: "fused")
    monkeypatch.setattr(moe, "fused_experts_grouped", lambda *a: "other")
    monkeypatch.setattr(moe, "fused_experts_reference", lambda *a: "other")
    x, ids = torch.zeros(slots // 8, 16, dtype=dtype), torch.zeros(slots // 8, 8, dtype=torch.long)
    w13, w2 = torch.zeros(4, 16, 16, dtype=dtype), torch.zeros(4, 16, 8, dtype=dtype)
    assert moe.fused_experts(x, w13, w2, ids.to(dtype), ids) == path


@cuda_only
@pytest.mark.parametrize("shape", ["thinker", "talker"])
@pytest.mark.parametrize("t", [1, 16, 64])
def test_real_shapes_match_grouped_path(shape: str, t: int) -> None:
    h, i, k = {"thinker": (2048, 768, 8), "talker": (1024, 384, 6)}[shape]
    x, w13, w2, weights, ids = moe_case(t=t, h=h, e=128, i=i, k=k)
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = triton_fused_moe.fused_moe(x, w13, w2, weights, ids)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    grouped = moe.fused_experts_grouped(x, w13, w2, weights, ids, fused_ops=True)
    diff = (out.float() - grouped.float()).abs()
    # NOTE: only the GEMMs' summation order differs from the grouped path: bf16 steps in some values
    assert rel(out, grouped) < 1e-2 and float(diff.mean() / grouped.float().abs().mean()) < 4e-3
    assert rel(out, reference(x, w13, w2, weights, ids)) < TOL


@cuda_only
def test_cuda_graph_replays_with_new_routing() -> None:
    e, k = 128, 8
    x, w13, w2, weights, ids = moe_case(t=16, h=256, e=e, i=64, k=k)
    out = triton_fused_moe.fused_moe(x, w13, w2, weights, ids)  # NOTE: compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_fused_moe.fused_moe(x, w13, w2, weights, ids)
    ids.copy_(skewed_ids(16, e, k, seed=2))  # expert 0 in every row: other blocks than the captured call had
    graph.replay()
    assert torch.equal(out, triton_fused_moe.fused_moe(x, w13, w2, weights, ids))
    assert rel(out, reference(x, w13, w2, weights, ids)) < TOL
