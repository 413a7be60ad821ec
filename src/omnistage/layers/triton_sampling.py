"""Token sampling as ONE Triton kernel per call (one program per row) for vocabularies up to `MAX_VOCAB`.

It computes what `sampling.sample` computes: penalties, suppressed ids, greedy argmax, temperature, top-k ->
top-p -> min-p, the exponential race with the same hash noise. Nothing is sorted: the k-th largest value and
the top-p edge are found by bisection over fp32 values ordered by their bit patterns (one count or masked
sum per step), and ties at the top-p edge are cut in index order, as the stable ascending sort of
`sampling.truncate` cuts them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from omnistage.layers import triton_ops, triton_pdl
from omnistage.layers.triton_ops import triton

if TYPE_CHECKING:
    from omnistage.layers.sampling import SamplingTensors

MAX_VOCAB = 8192
# probes per round of the threshold searches (one reduction a round); H200, B = 1, V = 2048, top-k 50, top-p 0.8:
# 2 (bisection) 30.9 us a call, 4 27.3, 8 29.5, 16 34.8 (scripts/sample_bench.py)
SEARCH_ARY = 4
# warps a program by BLOCK (the vocabulary's next power of two) where `scripts/sample_bench.py` measured a better
# count than the default, BLOCK / 512 within 4..16; H100, ARY 4, V = 2 048: 1 / 2 / 4 / 8 warps 90 / 49 / 27 / 23 us
# at B = 1 (the code predictor's draw), 92 / 50 / 28 / 24 at 64; V = 3 072 (BLOCK 4 096): 8 already the best
WARPS: dict[int, int] = {2048: 8}


def supports(logits: torch.Tensor) -> bool:
    """The fused sampler takes CUDA logits [B, V] with V <= MAX_VOCAB (fast path on)."""
    return triton_ops.fast_path(logits) and logits.dim() == 2 and logits.shape[1] <= MAX_VOCAB


if triton is not None:
    import triton.language as tl

    from omnistage.layers.triton_ops import libdevice, log_noise
    from omnistage.layers.triton_pdl import gdc

    @triton.jit
    def _order_key(x):
        bits = x.to(tl.int32, bitcast=True)
        key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
        return tl.where(key == -1, 0, key)  # NOTE: -0.0 == 0.0: one key, a tie as in torch's sort

    @triton.jit
    def _penalized(x, row, cols, m, seen_ptr, seen_stride, counts_ptr, counts_stride, sup_ptr, sup_stride,
                   rep_ptr, pres_ptr, freq_ptr, HAS_SEEN: tl.constexpr, HAS_COUNTS: tl.constexpr,
                   HAS_SUPPRESS: tl.constexpr):
        if HAS_SEEN:
            pen = tl.load(rep_ptr + row)
            seen = tl.load(seen_ptr + row * seen_stride + cols, mask=m, other=0) != 0
            x = tl.where(seen, tl.where(x < 0, x * pen, tl.math.div_rn(x, pen)), x)
        if HAS_COUNTS:
            c = tl.load(counts_ptr + row * counts_stride + cols, mask=m, other=0).to(tl.float32)
            x = x - tl.load(freq_ptr + row) * c
            x = x - tl.load(pres_ptr + row) * (c > 0).to(tl.float32)
        if HAS_SUPPRESS:
            sup = tl.load(sup_ptr + row * sup_stride + cols, mask=m, other=0) != 0
            x = tl.where(sup, -float("inf"), x)
        return x

    @triton.jit
    def _kth_key(key, m, top_k, vocab, ARY: tl.constexpr):
        lo = tl.min(tl.where(m, key, 2147483647), 0).to(tl.int64)
        hi = tl.where((top_k > 0) & (top_k < vocab), tl.max(key, 0).to(tl.int64), lo)
        j = tl.arange(0, ARY).to(tl.int64)
        while lo < hi:  # the largest key t with count(key >= t) >= k; ARY - 1 probes a round (one reduction)
            step = (hi - lo + ARY) // ARY
            t = lo + j * step
            count = tl.sum((m[None, :] & (key[None, :] >= t[:, None].to(tl.int32))).to(tl.int32), 1)
            last = tl.sum(((t <= hi) & (count >= top_k)).to(tl.int64), 0) - 1  # probe 0 (lo) always holds
            hi = tl.minimum(hi, lo + (last + 1) * step - 1)
            lo = lo + last * step
        return lo

    @triton.jit
    def _top_p_keep(key, p, live, thr, ARY: tl.constexpr):
        # NOTE: sums in another order than torch's softmax and cumsum move the edge (and the min-p cut) only
        # where a cumulative sum lies within float rounding (~1e-6) of `1 - top_p`. Ids with p == 0 are cut
        # as torch cuts them (a cumsum of 0 <= 1 - top_p); with top_p >= 1 no search runs.
        lo = tl.min(tl.where(live, key, 2147483647), 0).to(tl.int64)
        hi = tl.where(thr > 0, tl.max(key, 0).to(tl.int64), lo)
        j = tl.arange(0, ARY).to(tl.int64)
        while lo < hi:  # the smallest key t with sum(p[key <= t]) > thr, else the max; ARY probes a round
            step = (hi - lo + ARY) // ARY
            t = tl.minimum(lo + j * step, hi)
            mass = tl.sum(tl.where(key[None, :] <= t[:, None].to(tl.int32), p[None, :], 0.0), 1)
            first = tl.sum(((t < hi) & (mass <= thr)).to(tl.int64), 0)  # probes below the answer
            hi = tl.where(first < ARY, tl.minimum(lo + first * step, hi), hi)
            lo = tl.where(first > 0, lo + (first - 1) * step + 1, lo)
        tie = live & (key == lo)
        rank = tl.cumsum(tie.to(tl.int32), 0)
        below = tl.sum(tl.where(key < lo, p, 0.0), 0)
        pv = tl.max(tl.where(tie, p, 0.0), 0)
        cut = (rank < tl.sum(tie.to(tl.int32), 0)) & (below + rank.to(tl.float32) * pv <= thr)
        return live & (p > 0) & ((key > lo) | (tie & ~cut))

    @triton.jit
    def _truncated(x, m, top_k, top_p, min_p, vocab, ARY: tl.constexpr):
        key = _order_key(x)
        keep = m & (key >= _kth_key(key, m, top_k, vocab, ARY))
        x = tl.where(keep, x, -float("inf"))
        e = libdevice.exp(x - tl.max(x, 0))
        keep = _top_p_keep(key, tl.math.div_rn(e, tl.sum(e, 0)), keep, 1.0 - top_p, ARY)
        s = tl.sum(tl.where(keep, e, 0.0), 0)
        keep = keep & (tl.math.div_rn(e, s) >= min_p * tl.math.div_rn(1.0, s))
        return tl.where(keep, x, -float("inf"))

    @triton.jit
    def _race(x, cols, seed, step):
        return tl.argmax(x - log_noise(seed, step, cols), 0, tie_break_left=True)

    @triton.jit
    def _sample_kernel(x_ptr, x_stride, seen_ptr, seen_stride, counts_ptr, counts_stride, sup_ptr, sup_stride,
                       temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, rep_ptr, pres_ptr, freq_ptr, seeds_ptr,
                       steps_ptr, out_ptr, vocab, HAS_SEEN: tl.constexpr, HAS_COUNTS: tl.constexpr,
                       HAS_SUPPRESS: tl.constexpr, SAMPLE: tl.constexpr, TRUNCATE: tl.constexpr,
                       BLOCK: tl.constexpr, ARY: tl.constexpr, PDL: tl.constexpr):
        gdc(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        m = cols < vocab
        x = tl.load(x_ptr + row * x_stride + cols, mask=m, other=-float("inf")).to(tl.float32)
        x = _penalized(x, row, cols, m, seen_ptr, seen_stride, counts_ptr, counts_stride, sup_ptr, sup_stride,
                       rep_ptr, pres_ptr, freq_ptr, HAS_SEEN, HAS_COUNTS, HAS_SUPPRESS)
        token = tl.argmax(x, 0, tie_break_left=True)
        if SAMPLE:
            temp = tl.load(temp_ptr + row)
            x = tl.math.div_rn(x, tl.where(temp > 0, temp, 1.0))
            if TRUNCATE:
                x = _truncated(x, m, tl.load(top_k_ptr + row), tl.load(top_p_ptr + row),
                               tl.load(min_p_ptr + row), vocab, ARY)
            drawn = _race(x, cols, tl.load(seeds_ptr + row), tl.load(steps_ptr + row))
            token = tl.where(temp > 0, drawn, token)
        tl.store(out_ptr + row, token.to(tl.int64))


def _rows(t: torch.Tensor | None, fallback: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(tensor, row stride) of an optional [B, V] or [V] mask; a stand-in pointer when absent."""
    if t is None:
        return fallback, 0
    if t.stride(-1) != 1:
        t = t.contiguous()
    return t, t.stride(0) if t.dim() == 2 else 0


def fused_sample(logits: torch.Tensor, st: SamplingTensors, steps: torch.Tensor, seen: torch.Tensor | None = None,
                 counts: torch.Tensor | None = None, suppress: torch.Tensor | None = None) -> torch.Tensor:
    """`sampling.sample` in one launch: logits [B, V <= MAX_VOCAB] (any float dtype, read as fp32; rows may be
    strided), `st`'s [B] tensors and `steps` [B] contiguous. Token ids [B] int64; no host sync."""
    b, vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    out = torch.empty(b, dtype=torch.int64, device=logits.device)
    block = triton.next_power_of_2(vocab)
    # NOTE: no fused multiply-adds, so `x - f * count` rounds twice as the eager ops do.
    _sample_kernel[(b,)](
        logits, logits.stride(0), *_rows(seen, logits), *_rows(counts, logits), *_rows(suppress, logits),
        st.temperature, st.top_k, st.top_p, st.min_p, st.repetition_penalty, st.presence_penalty,
        st.frequency_penalty, st.seeds, steps, out, vocab, HAS_SEEN=seen is not None,
        HAS_COUNTS=counts is not None, HAS_SUPPRESS=suppress is not None, SAMPLE=not st.all_greedy,
        TRUNCATE=st.need_truncation, BLOCK=block, ARY=SEARCH_ARY,
        num_warps=WARPS.get(block, min(16, max(4, block // 512))), enable_fp_fusion=False, **triton_pdl.launch(logits))
    return out
