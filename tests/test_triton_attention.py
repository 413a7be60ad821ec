"""The decode attention kernels of `layers.triton_attention` against the torch paths they replace (store_kvcache +
paged_decode_attention, the code predictor's slice writes + SDPA): on the GPU in bf16 at the real head shapes, or
in Triton's interpreter on the CPU in fp32 (conftest); skipped without Triton."""

from __future__ import annotations

import pytest
import torch
from conftest import KERNEL_DEVICE as DEV

from omnistage.engine.cuda_graph import StaticDecodeContext
from omnistage.layers import attention, triton_attention, triton_ops
from omnistage.layers.attention import paged_attention_reference, paged_decode_attention, store_kvcache
from omnistage.layers.context import forward_context
from omnistage.models.qwen3_omni.code_predictor import StaticKVAttention, _Lockstep

pytestmark = pytest.mark.skipif(triton_ops.triton is None, reason="needs Triton")

GPU = DEV == "cuda"
DTYPE = torch.bfloat16 if GPU else torch.float32
TOL = dict(rtol=2e-2, atol=2e-2) if GPU else dict(rtol=1e-5, atol=1e-5)
HEADS = [(4, 2, 32), (6, 2, 24), (4, 4, 16)] + ([(32, 4, 128), (16, 2, 128)] if GPU else [])
BLOCK = 16
# 1 token, a block boundary, one past it, a whole BLOCK_N tile, several tiles and blocks (not a multiple of BLOCK_N)
LENS = [1, 16, 17, 64, 130, 53]


def spy(monkeypatch) -> list[int]:
    """Counts launches of the attention kernel."""
    kernel, seen = triton_attention._attention_with_kvcache_kernel, []

    class Spy:
        def __getitem__(self, grid):
            seen.append(grid)
            return kernel[grid]

    monkeypatch.setattr(triton_attention, "_attention_with_kvcache_kernel", Spy())
    return seen


def decode_batch(heads: int, kv: int, d: int, seed: int):
    """q/k/v of one decode step over LENS (shuffled blocks, random old cache contents) plus one padding row as the
    graph runners pad (scratch block, length 1); returns (q, k, v, k_cache, v_cache, ctx)."""
    g = torch.Generator().manual_seed(seed)
    width = -(-max(LENS) // BLOCK)
    num_blocks = len(LENS) * width + 1
    blocks = torch.randperm(num_blocks - 1, generator=g).view(len(LENS), width).tolist()
    static = StaticDecodeContext(len(LENS) + 1, width, BLOCK, num_blocks - 1, DEV)
    static.fill([n - 1 for n in LENS], blocks, len(LENS) + 1, width)
    rows = len(LENS) + 1
    q, k, v = (torch.randn(rows, h, d, generator=g).to(DEV, DTYPE) for h in (heads, kv, kv))
    caches = torch.randn(2, num_blocks, BLOCK, kv, d, generator=g).to(DEV, DTYPE)
    return q, k, v, caches[0], caches[1], static.context(rows, width)


@pytest.mark.parametrize("heads,kv,d", HEADS)
def test_decode_matches_store_and_paged_decode(heads: int, kv: int, d: int, monkeypatch) -> None:
    q, k, v, k_cache, v_cache, ctx = decode_batch(heads, kv, d, heads + d)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kvcache(k, v, k_ref, v_ref, ctx.slot_mapping)
    ref = paged_decode_attention(q, k_ref, v_ref, ctx, d**-0.5)
    launched = spy(monkeypatch)
    out = triton_attention.decode_attention_with_kvcache(q, k, v, k_cache, v_cache, ctx.slot_mapping,
                                                         ctx.block_tables, ctx.context_lens, d**-0.5)
    assert launched == [(len(LENS) + 1, kv)]
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)  # the new k/v, bit for bit
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.float(), ref.float(), **TOL)
    ctx.cu_seqlens_q = torch.arange(len(LENS) + 2, dtype=torch.int32, device=DEV)
    torch.testing.assert_close(out.float(), paged_attention_reference(q, k_ref, v_ref, ctx, d**-0.5).float(), **TOL)


def test_empty_row_writes_nothing() -> None:
    """A row of length 0 (a slot that may be garbage) writes nothing and returns finite values."""
    q, k, v, k_cache, v_cache, ctx = decode_batch(4, 2, 32, 1)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    ctx.context_lens[-1], ctx.slot_mapping[-1] = 0, 1 << 40
    out = triton_attention.decode_attention_with_kvcache(q, k, v, k_cache, v_cache, ctx.slot_mapping,
                                                         ctx.block_tables, ctx.context_lens, 32**-0.5)
    store_kvcache(k[:-1], v[:-1], k_ref, v_ref, ctx.slot_mapping[:-1])
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    assert torch.isfinite(out[-1]).all()
    ctx.context_lens, ctx.block_tables = ctx.context_lens[:-1], ctx.block_tables[:-1]
    torch.testing.assert_close(out[:-1].float(), paged_decode_attention(q[:-1], k_ref, v_ref, ctx, 32**-0.5).float(),
                               **TOL)


def test_attention_layer_path_choice(monkeypatch) -> None:
    """Decode steps take the kernel on the fast path (one launch, no store_kvcache); prefill keeps the torch path."""
    q, k, v, k_cache, v_cache, ctx = decode_batch(4, 2, 32, 2)
    outs, caches, launched = [], [], spy(monkeypatch)
    for fast in (False, True):
        monkeypatch.setattr(triton_ops, "fast_path", lambda t, fast=fast: fast)
        layer = attention.Attention(4, 2, 32, 32**-0.5)
        layer.k_cache, layer.v_cache = k_cache.clone(), v_cache.clone()
        with forward_context(ctx):
            outs.append(layer(q, k, v))
        caches.append((layer.k_cache, layer.v_cache))
    assert len(launched) == 1
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    torch.testing.assert_close(outs[1].float(), outs[0].float(), **TOL)
    ctx.is_prefill = True  # the same batch as a prefill: store_kvcache + the prefill backends
    with forward_context(ctx):
        layer(q, k, v)
    assert len(launched) == 1


CP_HEADS = [(4, 2, 32), (6, 2, 24)] + ([(16, 8, 128)] if GPU else [])


@pytest.mark.parametrize("heads,kv,d", CP_HEADS)
@pytest.mark.parametrize("pos,n", [(0, 2), (5, 1), (15, 1)])
def test_static_matches_code_predictor_sdpa(heads: int, kv: int, d: int, pos: int, n: int, monkeypatch) -> None:
    """The code predictor's first pass (positions 0, 1) and later ones; rows past `rows` and positions past
    pos + n hold large values that must be neither read nor written."""
    g = torch.Generator().manual_seed(pos * 7 + heads)
    rows, max_rows, groups = 3, 5, 16
    q, k, v = (torch.randn(rows * n, h, d, generator=g).to(DEV, DTYPE) for h in (heads, kv, kv))
    caches = torch.randn(2, max_rows, groups, kv, d, generator=g).to(DEV, DTYPE)
    caches[:, :, pos + n:] *= 100
    outs, states, launched = [], [], spy(monkeypatch)
    for fast in (False, True):
        monkeypatch.setattr(triton_ops, "fast_path", lambda t, fast=fast: fast)
        layer = StaticKVAttention(heads, kv, d, d**-0.5, _Lockstep(pos, rows))
        layer.k_cache, layer.v_cache = caches[0].clone(), caches[1].clone()
        outs.append(layer(q, k, v))
        states.append((layer.k_cache, layer.v_cache))
    assert launched == [(rows, kv)]
    assert torch.equal(states[0][0], states[1][0]) and torch.equal(states[0][1], states[1][1])
    assert outs[1].shape == q.shape and outs[1].dtype == q.dtype
    torch.testing.assert_close(outs[1].float(), outs[0].float(), **TOL)
