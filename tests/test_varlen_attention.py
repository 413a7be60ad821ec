"""Packed (varlen) prefill attention: `ForwardContext.kv_slots` and the varlen reference against the
per-sequence paged reference and a dense brute-force oracle (CPU fp32); the flash kernel on CUDA."""

from __future__ import annotations

import pytest
import torch

from omnistage.layers.attention import (
    flash_prefill_supported,
    paged_attention,
    paged_attention_reference,
    paged_prefill_attention,
    varlen_attention,
    varlen_attention_reference,
)
from omnistage.layers.context import build_context

# (cached, new) per sequence: fresh prompts, chunked prefill (q_len < k_len), a q_len=1 row, block boundaries
SPANS = [(0, 7), (5, 3), (9, 1), (0, 1), (4, 8), (11, 5)]


def _case(spans, heads, kv_heads, d, bs, seed, device="cpu", dtype=torch.float32):
    """Random caches (every slot filled, so a wrong slot changes the output) and shuffled block tables."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-(c + n) // bs) + i % 2 for i, (c, n) in enumerate(spans)]  # odd rows: an unused spare block
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = [perm[sum(need[:i]):sum(need[:i + 1])] for i in range(len(need))]
    k_cache, v_cache = torch.randn(2, num_blocks, bs, kv_heads, d, generator=g).unbind(0)
    q = torch.randn(sum(n for _, n in spans), heads, d, generator=g)
    ctx = build_context([c for c, _ in spans], [n for _, n in spans], tables, bs, device)
    to = dict(device=device, dtype=dtype)
    return q.to(**to), k_cache.to(**to), v_cache.to(**to), ctx, tables


def _dense(q, k_cache, v_cache, tables, spans, scale, bottom_right=True):
    """Oracle: explicit scores, query j of a (cached c, new n) sequence sees keys 0..c+j (top-left: 0..j)."""
    outs, row, bs = [], 0, k_cache.shape[1]
    for table, (c, n) in zip(tables, spans):
        pos = torch.arange(c + n, device=q.device)
        k = k_cache.flatten(0, 1)[torch.tensor(table, device=q.device)[pos // bs] * bs + pos % bs].float()
        v = v_cache.flatten(0, 1)[torch.tensor(table, device=q.device)[pos // bs] * bs + pos % bs].float()
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        scores = torch.einsum("qhd,khd->hqk", q[row:row + n].float(), k) * scale
        last = torch.arange(n, device=q.device)[:, None] + (c if bottom_right else 0)
        scores = scores.masked_fill(pos[None, :] > last, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
        row += n
    return torch.cat(outs)


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def test_kv_slots_and_slot_mapping_equal_python_reconstruction():
    bs = 4
    _, _, _, ctx, tables = _case(SPANS, 4, 2, 8, bs, seed=1)
    slots = lambda t, lo, hi: [t[p // bs] * bs + p % bs for p in range(lo, hi)]  # noqa: E731
    kv = [s for t, (c, n) in zip(tables, SPANS) for s in slots(t, 0, c + n)]
    new = [s for t, (c, n) in zip(tables, SPANS) for s in slots(t, c, c + n)]
    assert ctx.kv_slots.dtype == ctx.slot_mapping.dtype == torch.int64
    assert ctx.kv_slots.tolist() == kv and len(kv) == ctx.cu_seqlens_k[-1].item() == 54
    assert ctx.slot_mapping.tolist() == new and len(new) == 25
    decode = build_context([3, 8], [1, 1], tables[:2], bs)
    assert decode.kv_slots is None
    assert decode.slot_mapping.tolist() == [tables[0][0] * bs + 3, tables[1][2] * bs]


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (6, 1), (3, 3)])
def test_packed_prefill_equals_paged_reference(heads, kv_heads):
    d, bs, scale = 8, 4, 8**-0.5
    q, k_cache, v_cache, ctx, tables = _case(SPANS, heads, kv_heads, d, bs, seed=heads + kv_heads)
    packed = paged_prefill_attention(q, k_cache, v_cache, ctx, scale, varlen=varlen_attention_reference)
    ref = paged_attention_reference(q, k_cache, v_cache, ctx, scale)
    assert _err(packed, ref) < 1e-6
    assert _err(packed, _dense(q, k_cache, v_cache, tables, SPANS, scale)) < 1e-5
    # the cases tell the causal alignments apart (top-left would be off by O(1))
    assert _err(packed, _dense(q, k_cache, v_cache, tables, SPANS, scale, bottom_right=False)) > 0.2
    # on the CPU the backend choice keeps the per-sequence reference
    assert not flash_prefill_supported(q, ctx)
    assert torch.equal(paged_attention(q, k_cache, v_cache, ctx, scale), ref)


def test_varlen_reference_on_packed_tensors_equals_dense():
    g = torch.Generator().manual_seed(5)
    q_lens, k_lens, d = [3, 1, 6], [3, 9, 10], 16
    q, k, v = torch.randn(10, 4, d, generator=g), *torch.randn(2, 22, 2, d, generator=g).unbind(0)
    cu = lambda xs: torch.tensor([0, *xs], dtype=torch.int32).cumsum(0, dtype=torch.int32)  # noqa: E731
    out = varlen_attention_reference(q, k, v, cu(q_lens), cu(k_lens), 6, 10, 0.25)
    # the same packed tensors as a one-block-per-token "cache": the dense oracle reads them back
    tables = [list(range(s, s + n)) for s, n in zip(cu(k_lens).tolist(), k_lens)]
    spans = [(kl - ql, ql) for ql, kl in zip(q_lens, k_lens)]
    assert _err(out, _dense(q, k[:, None], v[:, None], tables, spans, 0.25)) < 1e-5


# the thinker's shape (32 / 4 heads, head_dim 128), the talker's (16 / 2), MHA at head_dim 64
GPU_CASES = [(32, 4, 128), (16, 2, 128), (4, 4, 64)]
GPU_SPANS = [(0, 300), (100, 57), (250, 1), (0, 1), (37, 200), (500, 16), (15, 17), (0, 64)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flash varlen attention needs CUDA")
@pytest.mark.parametrize("heads,kv_heads,d", GPU_CASES)
def test_flash_varlen_prefill_matches_reference_on_cuda(heads, kv_heads, d):
    bs, scale = 16, d**-0.5
    q, k_cache, v_cache, ctx, tables = _case(GPU_SPANS, heads, kv_heads, d, bs, seed=d + heads, device="cuda",
                                             dtype=torch.bfloat16)
    assert flash_prefill_supported(q, ctx) and not flash_prefill_supported(q.float(), ctx)
    out = paged_attention(q, k_cache, v_cache, ctx, scale)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, paged_prefill_attention(q, k_cache, v_cache, ctx, scale, varlen=varlen_attention))
    # the same bf16 values, attended in fp32 by the reference and by the dense oracle
    ref = paged_attention_reference(q.float(), k_cache.float(), v_cache.float(), ctx, scale)
    size = ref.abs().max().item()
    err = _err(out, ref) / size
    top_left = _err(out, _dense(q, k_cache, v_cache, tables, GPU_SPANS, scale, bottom_right=False)) / size
    print(f"flash varlen {heads}/{kv_heads}x{d}: max abs err / max |ref| ({size:.2f}) = {err:.2e} vs the "
          f"reference, {top_left:.2e} vs top-left causal")
    assert err < 1e-2, f"flash varlen relative error {err} (vs top-left causal: {top_left})"
    assert _err(ref, _dense(q, k_cache, v_cache, tables, GPU_SPANS, scale)) / size < 1e-3
    assert top_left > 0.1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flash varlen attention needs CUDA")
def test_flash_varlen_many_prompts_on_cuda():
    """64 prompts in one prefill (the TTFT case), one of them chunked, in fp16; prints both paths' times."""
    spans = [(0, 20 + 7 * i) for i in range(63)] + [(400, 100)]
    q, k_cache, v_cache, ctx, _ = _case(spans, 32, 4, 128, 16, seed=64, device="cuda", dtype=torch.float16)
    scale = 128**-0.5
    out = paged_prefill_attention(q, k_cache, v_cache, ctx, scale)
    ref = paged_attention_reference(q.float(), k_cache.float(), v_cache.float(), ctx, scale)
    err = _err(out, ref) / ref.abs().max().item()
    ms = [_cuda_ms(lambda: fn(q, k_cache, v_cache, ctx, scale))
          for fn in (paged_prefill_attention, paged_attention_reference)]
    print(f"flash varlen, 64 prompts ({q.shape[0]} tokens): max abs err / max |ref| = {err:.2e}; one layer "
          f"{ms[0]:.2f} ms packed vs {ms[1]:.2f} ms per-sequence reference (fp16)")
    assert err < 1e-2


def _cuda_ms(fn, reps: int = 10) -> float:
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps
