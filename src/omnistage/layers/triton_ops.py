"""Fused elementwise kernels (Triton) for the CUDA fast path; `fast_path(x)` is the ONE switch.

Each kernel replaces a chain of eager ops and rounds exactly where the eager chain does (every bf16 op
of torch computes in fp32 and rounds its result), so the only difference from the reference is the
order of the RMSNorm sum. Kernel counts per decoder layer drop from ~58 to ~24 (the talker's frame step
runs 15 code-predictor passes of 5 layers: launches, not bytes, bound it; BENCHMARKS.md).
- `rms_norm(x, w, eps, cos, sin)`: RMSNorm over the last dim, then (with cos/sin) rotate-half RoPE;
  q/k norm + RoPE of a layer are one kernel each instead of 2 x 14.
- `snake_beta(x, alpha, beta)`: code2wav's SnakeBeta, one pass instead of five over the largest tensors.
`OMNISTAGE_FUSED_OPS=0` turns the fast path off (ablation and A/B checks).
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # NOTE: CPU-only installs (CI) have no Triton; the reference path runs there.
    triton = None

ENABLED = os.environ.get("OMNISTAGE_FUSED_OPS", "1") != "0"


def fast_path(x: torch.Tensor) -> bool:
    """Fused kernels for CUDA half-precision tensors when Triton is present and not switched off."""
    return ENABLED and triton is not None and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)


if triton is not None:
    @triton.jit
    def _rms_norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, half, heads, eps,
                              ROPE: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        m = cols < half
        dt = out_ptr.dtype.element_ty
        base = row.to(tl.int64) * 2 * half
        lo = tl.load(x_ptr + base + cols, mask=m, other=0.0).to(tl.float32)
        hi = tl.load(x_ptr + base + half + cols, mask=m, other=0.0).to(tl.float32)
        var = (tl.sum(lo * lo, 0) + tl.sum(hi * hi, 0)) / (2 * half)
        r = libdevice.rsqrt(var + eps)
        w_lo = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
        w_hi = tl.load(w_ptr + half + cols, mask=m, other=0.0).to(tl.float32)
        y_lo = (w_lo * (lo * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        y_hi = (w_hi * (hi * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        if ROPE:
            t = (row // heads).to(tl.int64) * half
            c = tl.load(cos_ptr + t + cols, mask=m, other=0.0).to(tl.float32)
            s = tl.load(sin_ptr + t + cols, mask=m, other=0.0).to(tl.float32)
            a, b = (y_lo * c).to(dt).to(tl.float32), (y_hi * s).to(dt).to(tl.float32)
            d, e = (y_hi * c).to(dt).to(tl.float32), (y_lo * s).to(dt).to(tl.float32)
            y_lo, y_hi = a - b, d + e
        tl.store(out_ptr + base + cols, y_lo.to(dt), mask=m)
        tl.store(out_ptr + base + half + cols, y_hi.to(dt), mask=m)

    @triton.jit
    def _snake_beta_kernel(x_ptr, alpha_ptr, beta_ptr, out_ptr, length, channels, BLOCK: tl.constexpr):
        row = tl.program_id(0)  # (batch, channel)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = cols < length
        dt = out_ptr.dtype.element_ty
        ch = row % channels
        alpha = libdevice.exp(tl.load(alpha_ptr + ch).to(tl.float32)).to(dt).to(tl.float32)
        beta = libdevice.exp(tl.load(beta_ptr + ch).to(tl.float32)).to(dt).to(tl.float32)
        inv = (1.0 / (beta + 1e-9).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        base = row.to(tl.int64) * length
        x = tl.load(x_ptr + base + cols, mask=m, other=0.0).to(tl.float32)
        s = libdevice.sin((x * alpha).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        y = (inv * (s * s).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        tl.store(out_ptr + base + cols, (x + y).to(dt), mask=m)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor | None = None,
             sin: torch.Tensor | None = None) -> torch.Tensor:
    """Fused RMSNorm over the last dim of a contiguous `x`; with `cos/sin [T, D/2]` and `x [T, heads, D]`
    also rotate-half RoPE."""
    x = x.contiguous()
    d = x.shape[-1]
    out = torch.empty_like(x)
    rows = x.numel() // d
    heads = x.shape[1] if cos is not None else 1
    rope = cos is not None
    _rms_norm_rope_kernel[(rows,)](x, weight, cos if rope else x, sin if rope else x, out, d // 2, heads, eps,
                                   ROPE=rope, BLOCK=triton.next_power_of_2(d // 2))
    return out


def snake_beta(x: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """x + sin(x * e^alpha)^2 / (e^beta + 1e-9) per channel of `x [B, C, T]`, in one pass."""
    x = x.contiguous()
    b, c, t = x.shape
    out = torch.empty_like(x)
    block = 1024
    _snake_beta_kernel[(b * c, triton.cdiv(t, block))](x, alpha, beta, out, t, c, BLOCK=block)
    return out
