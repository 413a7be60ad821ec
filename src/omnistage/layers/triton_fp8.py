"""FP8 weights dequantised in one pass (Triton): `fp8.dequantize`'s `q x scale` per row in fp32, rounded to the
dtype, read once and written once. `moe.fused_experts` uses it for prefill-sized batches of FP8 experts, where
`torch._scaled_grouped_mm` is slower than dequantising and running the bf16 grouped GEMM (scripts/moe_tune.py
--prefill on the H200)."""

from __future__ import annotations

import torch

from omnistage.layers import triton_ops

BLOCK = 4096

if triton_ops.triton is not None:
    from omnistage.layers.triton_ops import tl, triton

    @triton.jit
    def _dequantize_kernel(q_ptr, scale_ptr, out_ptr, numel, row_len, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < numel
        q = tl.load(q_ptr + offs, mask=mask).to(tl.float32)
        scale = tl.load(scale_ptr + offs // row_len, mask=mask)
        tl.store(out_ptr + offs, (q * scale).to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`fp8.dequantize(q, scale, dtype)`, equal bit for bit; `q` contiguous, `scale` its rows' fp32 scales."""
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    grid = (triton.cdiv(q.numel(), BLOCK),)
    _dequantize_kernel[grid](q, scale.contiguous(), out, q.numel(), q.shape[-1], BLOCK=BLOCK)
    return out
