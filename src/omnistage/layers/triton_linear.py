"""Skinny GEMMs (Triton) for decode row counts, `x [M <= MAX_M, K] @ w [N, K]^T`; `layers.linear.linear` and
`layers.mlp` pick them where `supports` holds.

With 1-64 rows a GEMM is bound by streaming its weight. One program computes a [BLOCK_M, BLOCK_N] output tile
over all of K (fp32 sums, pipelined weight loads); with SPLIT_K > 1 it sums one K slice into an fp32 workspace
and a second kernel adds the slices in order (deterministic, no atomics). GATED: `silu(x @ Wg^T) * (x @ Wu^T)`
of the merged `[2I, K]` gate_up weight, the gate and up tiles of the same columns in one program, rounded
where eager rounds (each GEMM output, then `triton_activation.silu_mul_rounded`). FP8 weights (`layers.fp8`,
weight-only): E4M3 tiles loaded and converted to x's dtype, the fp32 sums times the row scales (any shape: `CONFIGS`'
None entries compare bf16 with cuBLAS). Tiles: `triton_linear_tiles` (from scripts/linear_bench.py on the H200),
else `config`'s heuristic. `OMNISTAGE_TRITON_LINEAR=0` turns it off.
"""

from __future__ import annotations

import os

import torch

from omnistage.layers import fp8, triton_ops, triton_pdl
from omnistage.layers.triton_linear_tiles import CONFIGS, FP8_CONFIGS, Config

ENABLED = os.environ.get("OMNISTAGE_TRITON_LINEAR", "1") != "0"
MAX_M = 64

if triton_ops.triton is not None:
    from omnistage.layers.triton_activation import silu_mul_rounded
    from omnistage.layers.triton_ops import tl, triton
    from omnistage.layers.triton_pdl import gdc

    @triton.jit
    def _finish(acc, acc_up, bias_ptr, cols, col_m, dt: tl.constexpr, HAS_BIAS: tl.constexpr,
                GATED: tl.constexpr):
        """fp32 sums -> output values, rounded where eager rounds (bias added before the one rounding)."""
        if GATED:
            out = silu_mul_rounded(acc.to(dt).to(tl.float32), acc_up.to(dt).to(tl.float32), dt)
        else:
            if HAS_BIAS:
                acc = acc + tl.load(bias_ptr + cols, mask=col_m, other=0.0).to(tl.float32)
            out = acc.to(dt)
        return out

    @triton.jit(do_not_specialize=["M"])
    def _skinny_gemm_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, M, N, stride_xm, K: tl.constexpr,
                            K_SPLIT: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
                            GATED: tl.constexpr, SPLIT_K: tl.constexpr, PRECISION: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        """out[rows, cols] of x[rows] @ w[cols]^T (GATED: and of w[N + cols]); SPLIT_K > 1: the fp32 sums over
        K slice program_id(2) into `out [SPLIT_K, M, N]` (GATED: `[SPLIT_K, M, 2N]`, up sums at N + cols).
        HAS_SCALE: `w` in FP8, row c's sums times scale[c]."""
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_m = cols < N
        gdc(PDL)
        dt = x_ptr.dtype.element_ty
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_m = rows < M
        ks = tl.program_id(2) * K_SPLIT + tl.arange(0, BLOCK_K)
        x = x_ptr + rows[:, None] * stride_xm + ks[None, :]
        w = w_ptr + cols[:, None] * K + ks[None, :]
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K_SPLIT, BLOCK_K):  # NOTE: the host fits BLOCK_K to divide K_SPLIT: no K mask
            a = tl.load(x + k0, mask=row_m[:, None], other=0.0)
            b = tl.load(w + k0, mask=col_m[:, None], other=0.0).to(dt)
            acc = tl.dot(a, tl.trans(b), acc, input_precision=PRECISION)
            if GATED:
                b_up = tl.load(w + N * K + k0, mask=col_m[:, None], other=0.0).to(dt)
                acc_up = tl.dot(a, tl.trans(b_up), acc_up, input_precision=PRECISION)
        if HAS_SCALE:
            acc *= tl.load(scale_ptr + cols, mask=col_m, other=0.0)[None, :]
            if GATED:
                acc_up *= tl.load(scale_ptr + N + cols, mask=col_m, other=0.0)[None, :]
        out_m = row_m[:, None] & col_m[None, :]
        if SPLIT_K == 1:
            out = _finish(acc, acc_up, bias_ptr, cols[None, :], col_m[None, :], out_ptr.dtype.element_ty,
                          HAS_BIAS, GATED)
            tl.store(out_ptr + rows[:, None] * N + cols[None, :], out, mask=out_m)
        else:
            width = N * 2 if GATED else N
            ws = out_ptr + (tl.program_id(2) * M + rows[:, None]) * width + cols[None, :]
            tl.store(ws, acc, mask=out_m)
            if GATED:
                tl.store(ws + N, acc_up, mask=out_m)

    @triton.jit(do_not_specialize=["M"])
    def _split_k_reduce_kernel(ws_ptr, bias_ptr, out_ptr, M, N, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
                               SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr):
        """out[row, cols] from the SPLIT_K slices' sums, added in slice order."""
        gdc(PDL)
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_m = cols < N
        width = N * 2 if GATED else N
        acc = tl.zeros([BLOCK_N], tl.float32)
        acc_up = tl.zeros([BLOCK_N], tl.float32)
        for s in range(SPLIT_K):
            src = ws_ptr + (s * M + row) * width + cols
            acc += tl.load(src, mask=col_m, other=0.0)
            if GATED:
                acc_up += tl.load(src + N, mask=col_m, other=0.0)
        out = _finish(acc, acc_up, bias_ptr, cols, col_m, out_ptr.dtype.element_ty, HAS_BIAS, GATED)
        tl.store(out_ptr + row * N + cols, out, mask=col_m)


def supports(x: torch.Tensor, weight: torch.Tensor, gated: bool = False, scale: torch.Tensor | None = None
             ) -> bool:
    """The skinny kernels take `x [M, K]` (unit column stride, 1 <= M <= MAX_M) and a contiguous
    `weight [N, K]` of x's dtype (with `scale`: FP8, x not fp32), K and N multiples of 16, on the fast path,
    unless `CONFIGS` leaves the (bf16) shape to cuBLAS."""
    dtype_ok = weight.dtype == x.dtype if scale is None else weight.dtype == fp8.FP8 and x.dtype != torch.float32
    return (ENABLED and triton_ops.fast_path(x) and x.dim() == 2 and x.stride(1) == 1
            and 0 < x.shape[0] <= MAX_M and weight.dim() == 2 and weight.is_contiguous()
            and dtype_ok and weight.shape[1] == x.shape[1] and x.shape[1] % 16 == 0
            and weight.shape[0] % 16 == 0 and weight.numel() < 2**31
            and (scale is not None or CONFIGS.get((*weight.shape, m_bucket(x.shape[0]), gated), ()) is not None))


def m_bucket(m: int) -> int:
    return max(16, triton.next_power_of_2(m))


def config(n: int, k: int, m: int, gated: bool, fp8_weight: bool = False) -> Config:
    """`CONFIGS[(n, k, m_bucket(m), gated)]` (FP8 weights: `FP8_CONFIGS`' entry first), else enough column tiles
    to cover the SMs (~132 on an H100/H200)."""
    key = (n, k, m_bucket(m), gated)
    tiles = FP8_CONFIGS.get(key) if fp8_weight else None
    tiles = tiles or CONFIGS.get(key)
    if tiles is not None:
        return tiles
    cols = n // 2 if gated else n
    block_n = 64 if cols >= 64 * 256 else 32 if cols >= 32 * 128 else 16
    return 16, block_n, 128 if block_n == 64 else 256, 4, 4, 1


def _fit(k: int, block_k: int, split_k: int) -> tuple[int, int]:
    """(BLOCK_K, SPLIT_K) with K a multiple of BLOCK_K * SPLIT_K (K is a multiple of 16)."""
    while k % (block_k * split_k):
        block_k, split_k = (block_k // 2, split_k) if block_k > 16 else (block_k, 1)
    return block_k, split_k


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gated: bool,
            scale: torch.Tensor | None) -> torch.Tensor:
    m, k = x.shape
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    block_m, block_n, block_k, warps, stages, split = config(weight.shape[0], k, m, gated, scale is not None)
    block_k, split = _fit(k, block_k, split)
    out = x.new_empty(m, n)
    bias_arg = out if bias is None else bias.contiguous()
    scale_arg = out if scale is None else scale
    flags = dict(HAS_BIAS=bias is not None, GATED=gated, SPLIT_K=split)
    # NOTE: fp32 inputs: tl.dot would multiply in tf32 on a GPU where F.linear does not.
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    ws = out if split == 1 else torch.empty(split, m, n * (2 if gated else 1), device=x.device,
                                            dtype=torch.float32)
    _skinny_gemm_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n), split)](
        x, weight, scale_arg, bias_arg, ws, m, n, x.stride(0), K=k, K_SPLIT=k // split, HAS_SCALE=scale is not None,
        PRECISION=precision,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages, **flags,
        **triton_pdl.launch(x))
    if split > 1:
        block = min(1024, triton.next_power_of_2(n))
        _split_k_reduce_kernel[(m, triton.cdiv(n, block))](ws, bias_arg, out, m, n, BLOCK_N=block, **flags,
                                                           **triton_pdl.launch(x))
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           scale: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` of `x [M, K]` -> `[M, N]` (see `supports`); `scale`: of an FP8 `weight`'s rows."""
    return _launch(x, weight, bias, False, scale)


def linear_silu_mul(x: torch.Tensor, gate_up_weight: torch.Tensor, scale: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """`silu(x @ Wg^T) * (x @ Wu^T)` of `gate_up_weight [2I, K]` (gate rows first) -> `[M, I]`."""
    return _launch(x, gate_up_weight, None, True, scale)
