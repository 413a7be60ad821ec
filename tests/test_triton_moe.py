"""The MoE bookkeeping kernels (layers.triton_moe) against the torch ops they replace: on the GPU, or in Triton's
interpreter on the CPU (conftest); skipped without Triton. The whole block's fast path and its CUDA graph: GPU only."""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
import torch.nn.functional as F

from omnistage.layers import moe, triton_fused_moe, triton_moe, triton_ops

from conftest import KERNEL_DEVICE as DEV
from test_triton_ops import ulps

pytestmark = pytest.mark.skipif(triton_ops.triton is None, reason="needs Triton")

# NOTE: the interpreter truncates fp32 -> bf16 (conftest): fp32 on the CPU, exact bf16 checks on the GPU only.
EXACT = DEV == "cuda"
DTYPE = torch.bfloat16 if EXACT else torch.float32
cuda_only = pytest.mark.skipif(not EXACT, reason="needs CUDA")


@contextlib.contextmanager
def eager():
    triton_ops.ENABLED = False
    try:
        yield
    finally:
        triton_ops.ENABLED = True


def rel(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.float() - ref.float()).abs().max() / ref.float().abs().max())


def skewed_ids(t: int, e: int, k: int, seed: int) -> torch.Tensor:
    """Top-k ids where expert 0 is in every row and the last quarter of the experts in none."""
    g = torch.Generator(DEV).manual_seed(seed)
    scores = torch.rand(t, e, device=DEV, generator=g)
    scores[:, 0], scores[:, e - e // 4:] = 2.0, -1.0
    return scores.topk(k, dim=-1).indices


@pytest.mark.parametrize("t,e,k,renorm", [(64, 128, 8, True), (37, 128, 6, False), (5, 12, 3, True)])
def test_route_matches_softmax_topk(t: int, e: int, k: int, renorm: bool) -> None:
    g = torch.Generator(DEV).manual_seed(t)
    logits = (torch.randn(t, e, device=DEV, generator=g) * 2).to(DTYPE)
    logits[0] = 0.5  # all tied: the lower expert first
    logits[1, 3:9] = 30.0
    weights, ids = triton_moe.route(logits, k, renorm)
    with eager():
        ref_w, ref_ids = moe.select_experts(logits, k, renorm)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    ref_vals = probs.gather(1, ref_ids)
    assert weights.dtype == logits.dtype and ids.dtype == torch.long
    assert torch.equal(probs.gather(1, ids), ref_vals)  # same experts up to ties, same order
    tied = (probs[:, None, :] == ref_vals[:, :, None]).sum(-1) > 1
    assert bool(((ids == ref_ids) | tied).all()) and bool((ids.sort(1).values.diff(dim=1) > 0).all())
    assert ids[0].tolist() == list(range(k)) and ids[1, :min(k, 6)].tolist() == list(range(3, 3 + min(k, 6)))
    if EXACT:  # NOTE: fp32 sums of the softmax/renormalisation may differ in order: a bf16 step, rarely
        assert ulps(weights, ref_w) <= 1 and (weights != ref_w).float().mean() < 0.01
    else:
        assert rel(weights, ref_w) < 1e-6


@pytest.mark.parametrize("t,e,k", [(1, 128, 8), (64, 128, 8), (37, 12, 3), (700, 16, 6)])
def test_align_matches_stable_argsort(t: int, e: int, k: int) -> None:
    ids = skewed_ids(t, e, k, seed=t)
    token, pos, offs = triton_moe.moe_align(ids, e)
    ref_token, ref_pos, ref_offs = moe.sort_by_expert(ids, e)
    counts = torch.bincount(ids.flatten(), minlength=e)
    assert (counts == 0).any() and counts[0] == t
    assert offs.dtype == torch.int32 and torch.equal(offs, ref_offs)
    assert torch.equal(offs.long(), counts.cumsum(0))
    assert torch.equal(pos, ref_pos) and torch.equal(token, ref_token)
    order = ids.flatten().argsort(stable=True)
    assert torch.equal(order[pos], torch.arange(t * k, device=DEV))


@pytest.mark.parametrize("t,k,h", [(37, 6, 96), (16, 8, 2048)])
def test_unpermute_matches_eager_chain(t: int, k: int, h: int) -> None:
    g = torch.Generator(DEV).manual_seed(h)
    y = torch.randn(t * k, h, device=DEV, generator=g).to(DTYPE)
    weights = torch.rand(t, k, device=DEV, generator=g).to(DTYPE)
    pos = torch.randperm(t * k, device=DEV, generator=g)
    out, ref = triton_moe.moe_unpermute(y, weights, pos), moe.unpermute(y, weights, pos)
    # NOTE: the products round to the dtype in both; torch may sum the k of them in another order, which is
    # exact in fp32 unless their exponents span > 16 binades, so bf16 results match exactly.
    assert torch.equal(out, ref) if EXACT else rel(out, ref) < 1e-6


@pytest.mark.parametrize("t,k,h", [(37, 6, 96), (16, 8, 2048)])
def test_unpermute_adds_the_gated_shared_expert(t: int, k: int, h: int) -> None:
    g = torch.Generator(DEV).manual_seed(h + 1)
    y = torch.randn(t * k, h, device=DEV, generator=g).to(DTYPE)
    weights = torch.rand(t, k, device=DEV, generator=g).to(DTYPE)
    pos = torch.randperm(t * k, device=DEV, generator=g)
    logits = (torch.randn(t, 9, device=DEV, generator=g) * 4).to(DTYPE)  # router logits with the gate last
    shared = (logits[:, 8:], torch.randn(t, h, device=DEV, generator=g).to(DTYPE))
    out = triton_moe.moe_unpermute(y, weights, pos, shared)
    ref = moe.add_shared(moe.unpermute(y, weights, pos), shared)
    assert torch.equal(out, ref) if EXACT else rel(out, ref) < 1e-6
    assert rel(out, moe.unpermute(y, weights, pos)) > 1e-2  # the shared term is there


def moe_case(t: int, h: int, e: int, i: int, k: int):
    g = torch.Generator(DEV).manual_seed(t)
    x = torch.randn(t, h, device=DEV, generator=g)
    w13 = torch.randn(e, 2 * i, h, device=DEV, generator=g) / h**0.5
    w2 = torch.randn(e, h, i, device=DEV, generator=g) / i**0.5
    weights, ids = triton_moe.route(x @ torch.randn(h, e, device=DEV, generator=g), k, True)
    return x.to(DTYPE), w13.to(DTYPE), w2.to(DTYPE), weights.to(DTYPE), ids


def test_kernels_around_an_expert_loop_match_reference() -> None:
    e, k = 16, 4
    x, w13, w2, weights, ids = moe_case(t=50, h=64, e=e, i=32, k=k)
    token, pos, offs = triton_moe.moe_align(ids, e)
    xs, ys = x[token], torch.empty_like(x).repeat(k, 1)
    bounds = [0] + offs.tolist()
    for ex in range(e):
        rows = slice(bounds[ex], bounds[ex + 1])
        gate, up = F.linear(xs[rows], w13[ex]).chunk(2, dim=-1)
        ys[rows] = F.linear(F.silu(gate) * up, w2[ex])
    out = triton_moe.moe_unpermute(ys, weights, pos)
    ref = moe.fused_experts_reference(x.float(), w13.float(), w2.float(), weights.float(), ids)
    assert rel(out, ref) < (2e-2 if EXACT else 1e-5)


def test_grouped_path_with_kernels_matches_torch_bookkeeping() -> None:
    try:
        torch._grouped_mm(torch.ones(2, 8, device=DEV, dtype=DTYPE), torch.ones(1, 8, 8, device=DEV, dtype=DTYPE),
                          offs=torch.tensor([2], dtype=torch.int32, device=DEV))
    except (AttributeError, RuntimeError, NotImplementedError):
        pytest.skip("no torch._grouped_mm here")
    x, w13, w2, weights, ids = moe_case(t=29, h=64, e=8, i=32, k=3)
    fused = moe.fused_experts_grouped(x, w13, w2, weights, ids, fused_ops=True)
    ref = moe.fused_experts_grouped(x, w13, w2, weights, ids, fused_ops=False)  # NOTE: silu_mul as in `fused`
    assert torch.equal(fused, ref) if EXACT else rel(fused, ref) < 1e-6


def block(e: int = 128, k: int = 8, h: int = 256, i: int = 64, shared: int = 128) -> moe.SparseMoeBlock:
    m = moe.SparseMoeBlock(h, e, k, i, True, shared).to(DEV)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.05)
    return m.to(torch.bfloat16)


@cuda_only
@pytest.mark.parametrize("t", [1, 64, 1100])  # 1100 * 8 slots: the torch sort, the un-permute kernel
def test_sparse_moe_block_fast_path_matches_reference(t: int, monkeypatch) -> None:
    calls = []
    for name in ("route", "moe_align", "moe_unpermute"):
        fn = getattr(triton_moe, name)
        monkeypatch.setattr(triton_moe, name, lambda *a, _fn=fn, _n=name: calls.append(_n) or _fn(*a))
    m = block()
    x = torch.randn(t, 256, device=DEV).bfloat16()
    with torch.no_grad():
        out = m(x)
        weights, ids = triton_moe.route(m.gate(x), 8, True)
        shared = torch.sigmoid(m.shared_expert_gate(x)) * m.shared_expert(x)
        exp = m.experts
        grouped = functools.partial(moe.fused_experts_grouped, fused_ops=False)
        experts = triton_fused_moe.fused_moe if t * 8 <= triton_fused_moe.MAX_SLOTS else grouped
        eager_out = experts(x, exp.gate_up_proj, exp.down_proj, weights, ids) + shared
        ref = moe.fused_experts_reference(x.float(), exp.gate_up_proj.float(), exp.down_proj.float(),
                                          weights.float(), ids)
    align = ["moe_align"] if t * 8 <= triton_moe.MAX_ALIGN_SLOTS else []
    assert calls[:2 + len(align)] == ["route", *align, "moe_unpermute"]
    assert torch.equal(out, eager_out)
    assert rel(out, ref + shared.float()) < 2e-2


@cuda_only
def test_sparse_moe_block_replays_in_a_cuda_graph() -> None:
    m = block(k=6)
    x = torch.randn(16, 256, device=DEV).bfloat16()
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            m(x)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = m(x)
        x.copy_(torch.randn_like(x))
        graph.replay()
        assert torch.equal(out, m(x))
