"""Fused MoE experts for decode sizes, and FP8 experts' prefill (Triton, vLLM `fused_moe` style);
`layers.moe.fused_experts` picks it.

At decode each hit expert gets 1-2 token rows, so the step is bound by reading the hit experts' weights.
`fused_moe` runs the experts as two launches of one kernel over blocks of `BLOCK_M` rows sorted by expert
(`triton_moe.moe_align`), each block within one expert:
- gated: `x[token] @ W_gate_up[e]^T` for a column tile of gate AND the same columns of up, then
  silu(gate) * up -> `act [T*k, I]` (no gathered copy of x, no `[T*k, 2I]` temporary);
- plain: `act @ W_down[e]^T` -> `y [T*k, H]`, then `triton_moe.moe_unpermute` scales by the routing
  weights and sums each token's k rows in a fixed order (deterministic, no atomics).
It rounds where the grouped path rounds (each GEMM output, the silu, the product, the weighted rows), so only
the GEMMs' summation order differs. FP8 experts (`scales`, weight-only): E4M3 tiles converted to x's dtype as they
load, each GEMM's fp32 sums times its expert's row scales before the rounding; at some prefill sizes the rows are
quantised too, for FP8 x FP8 dots (`prefill_plan`). The grid is fixed by T*k and E
(`max_blocks`): each program finds its block's expert from `offs` itself and programs past the last block exit; no
host syncs, CUDA-graph capturable.
"""

from __future__ import annotations

import os

import torch

from omnistage.layers import fp8, triton_moe, triton_ops, triton_pdl

# NOTE: decode tiles chosen without a GPU (tl.dot needs every dim >= 16): autotune on the H200.
BLOCK_M, BLOCK_N, BLOCK_K, NUM_WARPS, NUM_STAGES = 16, 64, 128, 4, 3
# FP8 experts' tiles (the same five; None: the bf16 ones): `scripts/moe_tune.py --fp8` on the H200 (`b655ffb`),
# within 0.5 % of each shape's best at 1 / 16 / 64 tokens; thinker, 64 tokens: 0.208 ms (bf16 experts 0.291)
FP8_TILES: tuple[int, int, int, int, int] | None = (16, 32, 128, 4, 3)
# FP8 experts past MAX_SLOTS (prefill), `prefill_plan`: `moe_tune.py --prefill`, H100 (`9f0e541`), ms a layer,
# thinker | talker (bf16 experts' grouped GEMMs). While the experts average under 32 rows: weight-only 32-row K-128
# tiles, 160 tokens 0.26 | 0.09 (0.47 | 0.15). Past that each GEMM's rows are quantised per row too (one kernel,
# `fp8.quantize_rows`) for FP8 x FP8 dots with 64-row K-128 tiles: 640 / 2 048 / 4 096 tokens thinker 0.28 / 0.46 /
# 0.83 (0.51 / 0.82 / 1.00); talker 2 048 / 4 096 0.17 / 0.28, where weight-only's best tiles took 0.21 / 0.38.
FP8_FEW_ROWS_TILES, FP8_DOTS_TILES = (32, 64, 128, 4, 3), (64, 64, 128, 4, 3)
# OMNISTAGE_FP8_DOTS=0: weight-only at every size (A/B; `scripts/fp8_logits.py --weight-only` scores the dots so)
FP8_DOTS = os.environ.get("OMNISTAGE_FP8_DOTS", "1") != "0"
# NOTE: up to this many slots (T*k) `fused_experts` takes this path for bf16 experts, above it the grouped GEMMs: a
# guess. FP8 experts take it at every size, past it as `prefill_plan` says.
MAX_SLOTS = 512

if triton_ops.triton is not None:
    from omnistage.layers.triton_activation import silu_mul_rounded
    from omnistage.layers.triton_ops import tl, triton
    from omnistage.layers.triton_pdl import gdc

    @triton.jit
    def _block_rows(offs_ptr, block, NUM_EXPERTS: tl.constexpr, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
        """(expert, sorted rows, row mask) of `block`: expert e owns cdiv(rows of e, BLOCK_M) blocks, in
        expert order; expert == NUM_EXPERTS past the last block."""
        experts = tl.arange(0, E_PAD)
        m = experts < NUM_EXPERTS
        end = tl.load(offs_ptr + experts, mask=m, other=0)
        start = tl.load(offs_ptr + experts - 1, mask=m & (experts > 0), other=0)
        blocks = (end - start + BLOCK_M - 1) // BLOCK_M
        last = tl.cumsum(blocks, 0)
        e = tl.sum((last <= block).to(tl.int32), 0)
        mine = experts == e
        first = tl.sum(tl.where(mine, start + (block - last + blocks) * BLOCK_M, 0), 0)
        rows = first + tl.arange(0, BLOCK_M)
        return e, rows, rows < tl.sum(tl.where(mine, end, 0), 0)

    @triton.jit
    def _expert_gemm_kernel(a_ptr, a_scale_ptr, w_ptr, scale_ptr, token_ptr, offs_ptr, out_ptr, stride_we, stride_wn,
                            stride_se, NUM_EXPERTS: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
                            GATED: tl.constexpr, HAS_SCALE: tl.constexpr, A_SCALE: tl.constexpr, E_PAD: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        """out[rows, cols] of one block of sorted rows (one expert e) and one column tile: GATED, rows of `a`
        read through `token`, silu(a @ W[e, cols]^T) * (a @ W[e, N + cols]^T); else a[rows] @ W[e, cols]^T.
        HAS_SCALE: W in FP8, row c of expert e's sums times scale[e, c]; A_SCALE: `a` in FP8 too (FP8 dots), each
        row's sums times its a_scale."""
        gdc(PDL)
        e, rows, row_m = _block_rows(offs_ptr, tl.program_id(0), NUM_EXPERTS, E_PAD, BLOCK_M)
        if e >= NUM_EXPERTS:
            return
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_m = cols < N
        ks = tl.arange(0, BLOCK_K)
        src = tl.load(token_ptr + rows, mask=row_m, other=0) if GATED else rows.to(tl.int64)
        a = a_ptr + src[:, None] * K + ks[None, :]
        w = w_ptr + e.to(tl.int64) * stride_we + cols[:, None] * stride_wn + ks[None, :]
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        dt = out_ptr.dtype.element_ty
        w_dt = w_ptr.dtype.element_ty if A_SCALE else dt  # FP8 dots, or the weights converted to the rows' dtype
        for k0 in range(0, K, BLOCK_K):
            k_m = k0 + ks < K
            x = tl.load(a + k0, mask=row_m[:, None] & k_m[None, :], other=0.0)
            w_m = col_m[:, None] & k_m[None, :]
            acc = tl.dot(x, tl.trans(tl.load(w + k0, mask=w_m, other=0.0).to(w_dt)), acc)
            if GATED:
                acc_up = tl.dot(x, tl.trans(tl.load(w + N * stride_wn + k0, mask=w_m, other=0.0).to(w_dt)), acc_up)
        if A_SCALE:
            sa = tl.load(a_scale_ptr + src, mask=row_m, other=0.0)[:, None]
            acc *= sa
            if GATED:
                acc_up *= sa
        if HAS_SCALE:
            s = scale_ptr + e.to(tl.int64) * stride_se + cols
            acc *= tl.load(s, mask=col_m, other=0.0)[None, :]
            if GATED:
                acc_up *= tl.load(s + N, mask=col_m, other=0.0)[None, :]
        out = acc.to(dt)
        if GATED:
            out = silu_mul_rounded(out.to(tl.float32), acc_up.to(dt).to(tl.float32), dt)
        dst = out_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :]
        tl.store(dst, out, mask=row_m[:, None] & col_m[None, :])


def max_blocks(num_slots: int, num_experts: int, block_m: int = BLOCK_M) -> int:
    """Blocks of `block_m` rows that `num_slots` rows sorted by expert can need: sum_e cdiv(rows of e,
    block_m) over the at most min(num_slots, num_experts) hit experts."""
    return triton.cdiv(num_slots, block_m) + min(num_slots, num_experts)


Tiles = tuple[int, int, int, int, int]


def tiles(fp8_experts: bool) -> Tiles:
    """Decode-size tiles (up to MAX_SLOTS; FP8 experts past it: `prefill_plan`)."""
    if fp8_experts and FP8_TILES is not None:
        return FP8_TILES
    return BLOCK_M, BLOCK_N, BLOCK_K, NUM_WARPS, NUM_STAGES


def prefill_plan(num_slots: int, num_experts: int) -> tuple[Tiles, bool]:
    """FP8 experts past MAX_SLOTS: (tiles, whether each GEMM's rows are quantised for FP8 x FP8 dots)."""
    if num_slots < 32 * num_experts:
        return FP8_FEW_ROWS_TILES, False
    return FP8_DOTS_TILES, FP8_DOTS


def expert_gemm(a: torch.Tensor, w: torch.Tensor, token: torch.Tensor, offs: torch.Tensor,
                gated: bool, scale: torch.Tensor | None = None,
                a_scale: tuple[torch.Tensor, torch.dtype] | None = None, tile: Tiles | None = None) -> torch.Tensor:
    """Per sorted row of expert e (`token`, `offs` from `moe_align`): gated, `silu_mul(a[token] @ w[e]^T)`
    with `w [E, 2N, K]` -> [T*k, N]; else `a @ w[e]^T` with `a [T*k, K]`, `w [E, N, K]` -> [T*k, N];
    `scale [E, rows of w]`: `w` is FP8; `a_scale` (a's row scales, the output's dtype): `a` is FP8 too; `tile`:
    its tiles (default `tiles()`)."""
    a = a.contiguous()
    if w.stride(-1) != 1:
        w = w.contiguous()
    num_experts, n, k = w.shape
    n //= 2 if gated else 1
    out = a.new_empty(token.numel(), n, dtype=a.dtype if a_scale is None else a_scale[1])
    bm, bn, bk, warps, stages = tile or tiles(scale is not None)
    grid = (max_blocks(token.numel(), num_experts, bm), triton.cdiv(n, bn))
    scale_arg = out if scale is None else scale
    _expert_gemm_kernel[grid](a, out if a_scale is None else a_scale[0], w, scale_arg, token, offs, out, w.stride(0),
                              w.stride(1), scale_arg.stride(0), NUM_EXPERTS=num_experts, N=n, K=k, GATED=gated,
                              HAS_SCALE=scale is not None, A_SCALE=a_scale is not None,
                              E_PAD=triton.next_power_of_2(num_experts),
                              BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages,
                              **triton_pdl.launch(a))
    return out


def fused_moe(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor, shared: tuple[torch.Tensor, torch.Tensor] | None = None,
              scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """`out [T, H]` of `x [T, H]` through the experts `ids [T, k]` weighted by `weights [T, k]`;
    `w_gate_up [E, 2I, H]` (gate rows first), `w_down [E, H, I]`; `shared`: see `triton_moe.moe_unpermute`;
    `scales`: FP8 experts' row scales (`[E, 2I]`, `[E, H]`)."""
    # NOTE: on a GPU tl.dot multiplies fp32 inputs in tf32: `fused_experts` sends only bf16 here.
    s13, s2 = (None, None) if scales is None else scales
    token, pos, offs = triton_moe.moe_align(ids, w_gate_up.shape[0])
    tile, dots = None, False
    if scales is not None and ids.numel() > MAX_SLOTS:
        tile, dots = prefill_plan(ids.numel(), w_gate_up.shape[0])
    q, sa = fp8_rows(x, dots)
    act = expert_gemm(q, w_gate_up, token, offs, True, s13, sa, tile)
    q, sa = fp8_rows(act, dots)
    y = expert_gemm(q, w_down, token, offs, False, s2, sa, tile)
    return triton_moe.moe_unpermute(y, weights, pos, shared)


def fp8_rows(a: torch.Tensor, quantize: bool) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.dtype] | None]:
    """(rows, their `a_scale`) as `expert_gemm` takes them: `a` quantised per row (`fp8.quantize_rows`) with (its
    scales, a's dtype), or `a` as it is and None."""
    if not quantize:
        return a, None
    q, scale = fp8.quantize_rows(a)
    return q, (scale, a.dtype)
