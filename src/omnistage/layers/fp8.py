"""FP8 weights (`quantization: fp8`): E4M3 values with one fp32 scale per output row (amax x (1 / 448); experts: per
expert per row), made from the stage's weights at load. `layers.linear.linear` and `layers.moe.fused_experts` choose
the path; here the pieces: rows quantised (weights once, activations per token on the fly), the reference
dequantisation, and `torch._scaled_mm` with rowwise scales (CUDA, rows past the skinny GEMMs' decode sizes)."""

from __future__ import annotations

import torch

from omnistage.layers import triton_ops, triton_quant

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
MIN_SCALE = 1e-12  # NOTE: an all-zero row keeps a finite scale, so its values quantise to exact zeros


def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(`t` in E4M3 with each last-dim row scaled to its amax, fp32 scales `t.shape[:-1]`); `dequantize` inverts
    it within E4M3's rounding (3 mantissa bits: each element within 2^-4 of itself, or of 2^-9 x its row scale
    below the normal range). On the fast path one Triton kernel, bitwise the same."""
    if triton_ops.fast_path(t) and t.shape[-1] <= triton_quant.MAX_COLS:
        return triton_quant.quantize_rows(t, FP8, FP8_MAX, MIN_SCALE)
    return quantize_rows_reference(t)


def quantize_rows_reference(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows` in torch's ops (any device)."""
    # NOTE: x (1 / 448), not / 448: torch on CUDA turns a division by a scalar into that product, on the CPU it does
    # not; written as the product both give the same bits (and so does `triton_quant`)
    scale = (t.abs().amax(dim=-1).float() * (1 / FP8_MAX)).clamp(min=MIN_SCALE)
    q = (t.float() / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The reference: `q x scale` per row, in `dtype`."""
    return (q.float() * scale[..., None]).to(dtype)


def scaled_mm_supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """`torch._scaled_mm` (rowwise) takes `x [M, K]` in bf16 on CUDA with K and N multiples of 16."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and x.dim() == 2 and weight.is_contiguous()
            and x.shape[1] % 16 == 0 and weight.shape[0] % 16 == 0)


def scaled_mm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
              ) -> torch.Tensor:
    """`x @ (weight x scale)^T + bias` with `x` quantised per token (dynamic scales); fp32 sums, out in x's dtype;
    no host sync (CUDA-graph capturable)."""
    xq, xs = quantize_rows(x)
    out = torch._scaled_mm(xq, weight.t(), scale_a=xs[:, None], scale_b=scale[None, :], out_dtype=x.dtype)
    return out if bias is None else out + bias
