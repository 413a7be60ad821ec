"""RMSNorm kernels (Triton) for the CUDA fast path (`layers.norm` picks them through `triton_ops.fast_path`).

They round where the eager chain (`norm.rms_norm_reference`, `rotary.apply_rotary_emb`) rounds, so the only
difference from it is the order of the sum of squares.
- `rms_norm(x, w, eps, cos, sin)`: RMSNorm over the last dim, then (with cos/sin) rotate-half RoPE;
  `rms_norm_qk` does a layer's q and k norms + RoPE in one kernel, reading (strided) rows of the fused
  qkv GEMM output in place; cos/sin rows may be strided (stride 0: one position's table for every token).
- `add_rms_norm(x, residual, w, eps)`: a residual add (rounded to the dtype, as eager) and the RMSNorm after it in
  one kernel (vLLM's fused_add_rms_norm, out of place): the decoder carries its residual stream separately so
  every norm after the first is fused with the add before it.
"""

from __future__ import annotations

import torch

from omnistage.layers import triton_ops, triton_pdl

if triton_ops.triton is not None:
    from omnistage.layers.triton_ops import libdevice, tl, triton
    from omnistage.layers.triton_pdl import gdc

    @triton.jit
    def _normed(v, r, w, dt):
        """`w * (v * r).to(dt)` rounded as eager rounds it (each op rounds to dt), back in fp32."""
        return (w * (v * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)

    @triton.jit
    def _rms_norm_rope_kernel(x_ptr, w_ptr, w2_ptr, cos_ptr, sin_ptr, out_ptr, out2_ptr, half, heads, split,
                              stride_t, stride_h, stride_cs, eps, ROPE: tl.constexpr, BLOCK: tl.constexpr,
                              PDL: tl.constexpr):
        gdc(PDL)
        row = tl.program_id(0)  # (token, head); heads < split: weight w, output out; the others w2, out2
        tok, head = row // heads, row % heads
        cols = tl.arange(0, BLOCK)
        m = cols < half
        # NOTE: `first` as a block, not a scalar: Triton 3.9's interpreter takes only block masks
        first = (cols * 0 + head) < split
        dt = out_ptr.dtype.element_ty
        src = tok.to(tl.int64) * stride_t + head * stride_h
        lo = tl.load(x_ptr + src + cols, mask=m, other=0.0).to(tl.float32)
        hi = tl.load(x_ptr + src + half + cols, mask=m, other=0.0).to(tl.float32)
        var = (tl.sum(lo * lo, 0) + tl.sum(hi * hi, 0)) / (2 * half)
        r = libdevice.rsqrt(var + eps)
        w, w2 = w_ptr + cols, w2_ptr + cols
        w_lo = tl.where(first, tl.load(w, mask=m), tl.load(w2, mask=m)).to(tl.float32)
        w_hi = tl.where(first, tl.load(w + half, mask=m), tl.load(w2 + half, mask=m)).to(tl.float32)
        y_lo, y_hi = _normed(lo, r, w_lo, dt), _normed(hi, r, w_hi, dt)
        if ROPE:
            t = tok.to(tl.int64) * stride_cs
            c = tl.load(cos_ptr + t + cols, mask=m, other=0.0).to(tl.float32)
            s = tl.load(sin_ptr + t + cols, mask=m, other=0.0).to(tl.float32)
            a, b = (y_lo * c).to(dt).to(tl.float32), (y_hi * s).to(dt).to(tl.float32)
            d, e = (y_hi * c).to(dt).to(tl.float32), (y_lo * s).to(dt).to(tl.float32)
            y_lo, y_hi = a - b, d + e
        # NOTE: both stores are masked by `first`; the clamped head keeps the masked-off address in bounds.
        dst = (tok.to(tl.int64) * split + tl.minimum(head, split - 1)) * 2 * half
        dst2 = (tok.to(tl.int64) * (heads - split) + tl.maximum(head - split, 0)) * 2 * half
        tl.store(out_ptr + dst + cols, y_lo.to(dt), mask=m & first)
        tl.store(out_ptr + dst + half + cols, y_hi.to(dt), mask=m & first)
        tl.store(out2_ptr + dst2 + cols, y_lo.to(dt), mask=m & ~first)
        tl.store(out2_ptr + dst2 + half + cols, y_hi.to(dt), mask=m & ~first)

    @triton.jit
    def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, n, stride_x, stride_r, eps,
                             BLOCK: tl.constexpr, PDL: tl.constexpr):
        gdc(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        m = cols < n
        dt = out_ptr.dtype.element_ty
        x = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0).to(tl.float32)
        res = tl.load(res_ptr + row * stride_r + cols, mask=m, other=0.0).to(tl.float32)
        h = (res + x).to(dt)
        tl.store(sum_ptr + row * n + cols, h, mask=m)
        h = h.to(tl.float32)
        r = libdevice.rsqrt(tl.sum(h * h, 0) / n + eps)
        w = tl.load(w_ptr + cols, mask=m).to(tl.float32)
        tl.store(out_ptr + row * n + cols, _normed(h, r, w, dt).to(dt), mask=m)


def _norm_rows(x: torch.Tensor, weight: torch.Tensor, weight2: torch.Tensor, split: int, eps: float,
               cos: torch.Tensor | None, sin: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One launch over the rows of `x [T, heads, D]`: heads < split -> (weight, first output [T, split, D]),
    the others -> (weight2, second output [T, heads - split, D]). Rows are read through x's strides."""
    t, heads, d = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = x.new_empty(t, split, d)
    out2 = x.new_empty(t, heads - split, d) if heads > split else out
    rope = cos is not None
    if rope and (cos.stride(-1) != 1 or sin.stride() != cos.stride()):
        cos, sin = cos.contiguous(), sin.contiguous()
    _rms_norm_rope_kernel[(t * heads,)](
        x, weight, weight2, cos if rope else x, sin if rope else x, out, out2, d // 2, heads, split,
        x.stride(0), x.stride(1), cos.stride(0) if rope else 0, eps, ROPE=rope, BLOCK=triton.next_power_of_2(d // 2),
        **triton_pdl.launch(x))
    return out, out2


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor | None = None,
             sin: torch.Tensor | None = None) -> torch.Tensor:
    """Fused RMSNorm over the last dim of `x` (rows may be strided); with `cos/sin [T, D/2]` and
    `x [T, heads, D]` also rotate-half RoPE (cos/sin rows may be strided too, e.g. one position's row expanded
    over all tokens: stride 0). Returns a contiguous tensor."""
    x3 = x if cos is not None else x.reshape(-1, 1, x.shape[-1])
    return _norm_rows(x3, weight, weight, x3.shape[1], eps, cos, sin)[0].view(x.shape)


def rms_norm_qk(qk: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, num_q_heads: int,
                eps: float, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k heads of `qk [T, Hq + Hk, D]` (e.g. a slice of a fused qkv GEMM output, no copy) normed with
    their own weights, then RoPE, in one launch -> contiguous (q [T, Hq, D], k [T, Hk, D])."""
    return _norm_rows(qk, q_weight, k_weight, num_q_heads, eps, cos, sin)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(residual + x), residual + x) over the last dim in one launch; `x` and `residual` have one shape
    (rows may be strided). Returns contiguous tensors."""
    n = x.shape[-1]
    x2, r2 = (t.reshape(-1, n) for t in (x, residual))
    x2, r2 = (t if t.stride(-1) == 1 else t.contiguous() for t in (x2, r2))
    out, total = x2.new_empty(x2.shape), x2.new_empty(x2.shape)
    _add_rms_norm_kernel[(x2.shape[0],)](x2, r2, weight, out, total, n, x2.stride(0), r2.stride(0), eps,
                                         BLOCK=triton.next_power_of_2(n), **triton_pdl.launch(x2))
    return out.view(x.shape), total.view(x.shape)
