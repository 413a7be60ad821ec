"""Per-row FP8 quantisation (Triton) for the CUDA fast path (`fp8.quantize_rows` picks it): one kernel a row instead
of torch's six passes over the tensor (abs, amax, float, divide, clamp, convert), as FP8 activations need it per
token (`fp8.scaled_mm`, the FP8 experts' prefill dots). Bitwise the reference: the same fp32 amax x (1 / 448),
IEEE division and clamp, then round-to-nearest-even onto the E4M3 grid in exact fp32 arithmetic, so that the final
conversion only ever meets a value E4M3 holds exactly (Triton's interpreter converts others without carrying a
rounding into the exponent, and flushes some subnormals: the CPU test could not check the bytes otherwise).
"""

from __future__ import annotations

import torch

from omnistage.layers import triton_ops

MAX_COLS = 16384  # NOTE: a row is one block of registers; longer rows take the reference

if triton_ops.triton is not None:
    from omnistage.layers.triton_ops import libdevice, tl, triton

    @triton.jit
    def _e4m3_grid(q):
        """`q` (|q| <= 448) rounded to E4M3's nearest value, ties to even, its sign kept (-0.0 too)."""
        a = tl.abs(q)
        e = tl.maximum((a.to(tl.int32, bitcast=True) >> 23) - 127, -6)  # NOTE: below 2^-6 the subnormals' spacing
        spacing = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
        per_spacing = ((3 - e + 127) << 23).to(tl.float32, bitcast=True)
        # NOTE: + 1.5 x 2^23 then - 1.5 x 2^23 rounds to an integer (ties to even); powers of two: products exact
        r = ((a * per_spacing + 12582912.0) - 12582912.0) * spacing
        return tl.where(q.to(tl.int32, bitcast=True) < 0, -1.0, 1.0) * r  # NOTE: on the GPU -r gave +0.0 for r = +0.0

    @triton.jit
    def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, n, FP8_MAX: tl.constexpr, INV_MAX: tl.constexpr,
                              MIN_SCALE: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        m = cols < n
        x = tl.load(x_ptr + row * n + cols, mask=m, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x), 0) * INV_MAX, MIN_SCALE)
        q = _e4m3_grid(tl.minimum(tl.maximum(libdevice.div_rn(x, scale), -FP8_MAX), FP8_MAX))
        tl.store(q_ptr + row * n + cols, q.to(q_ptr.dtype.element_ty), mask=m)
        tl.store(scale_ptr + row, scale)


def quantize_rows(t: torch.Tensor, dtype: torch.dtype, fp8_max: float, min_scale: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """`fp8.quantize_rows` of `t [..., n]` (n <= MAX_COLS) in one kernel: (`dtype` values, fp32 scales `[...]`)."""
    n = t.shape[-1]
    x = t.reshape(-1, n).contiguous()
    q = torch.empty(x.shape, dtype=dtype, device=t.device)
    scale = torch.empty(x.shape[0], dtype=torch.float32, device=t.device)
    if x.shape[0]:
        block = triton.next_power_of_2(n)
        _quantize_rows_kernel[(x.shape[0],)](x, q, scale, n, FP8_MAX=fp8_max, INV_MAX=1 / fp8_max, MIN_SCALE=min_scale,
                                             BLOCK=block, num_warps=4 if block <= 2048 else 8)
    return q.view(t.shape), scale.view(t.shape[:-1])
