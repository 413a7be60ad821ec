"""Code2wav decoder kernels (Triton) for the CUDA fast path (`models.qwen3_omni.code2wav_fused` calls them).

- `bias_residual(x, y, bias, x_bias)`: a residual unit's `x + conv2(...)` with conv2's bias add folded in (and the
  bias of a transposed conv whose trimmed, strided output `x` is), rounded where eager rounds: one pass instead of
  cuDNN's separate in-place bias add plus the add.
- `conv1d_out1(x, weight, bias)`: the decoder's last conv (C -> 1 channel, kernel K, no padding) as a direct conv
  with fp32 accumulation, one read of the input and no cuDNN layout change of its [B, C, T] input.
"""

from __future__ import annotations

import torch

from omnistage.layers import triton_ops

if triton_ops.triton is not None:
    from omnistage.layers.triton_ops import tl, triton

    @triton.jit
    def _bias_residual_kernel(x_ptr, x_bias_ptr, y_ptr, bias_ptr, out_ptr, length, channels, sxb, sxc, sxt,
                              HAS_X_BIAS: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)  # (batch, channel)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = cols < length
        dt = out_ptr.dtype.element_ty
        b, ch = (row // channels).to(tl.int64), row % channels
        x = tl.load(x_ptr + b * sxb + ch.to(tl.int64) * sxc + cols * sxt, mask=m, other=0.0).to(tl.float32)
        if HAS_X_BIAS:
            x = (x + tl.load(x_bias_ptr + ch).to(tl.float32)).to(dt).to(tl.float32)
        dense = row.to(tl.int64) * length + cols
        y = tl.load(y_ptr + dense, mask=m, other=0.0).to(tl.float32)
        y = (y + tl.load(bias_ptr + ch).to(tl.float32)).to(dt).to(tl.float32)
        tl.store(out_ptr + dense, (x + y).to(dt), mask=m)

    @triton.jit
    def _conv1d_out1_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, length, sxb, sxc, CHANNELS: tl.constexpr,
                            KERNEL: tl.constexpr, BLOCK_T: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
        m = cols < length
        row = x_ptr + b * sxb + cols
        acc = tl.zeros([BLOCK_T], dtype=tl.float32)
        for c in range(CHANNELS):
            for k in tl.static_range(KERNEL):
                w = tl.load(w_ptr + c * KERNEL + k).to(tl.float32)
                acc += tl.load(row + c * sxc + k, mask=m, other=0.0).to(tl.float32) * w
        dt = out_ptr.dtype.element_ty
        y = acc.to(dt).to(tl.float32) + tl.load(bias_ptr).to(tl.float32)
        tl.store(out_ptr + b * length + cols, y.to(dt), mask=m)


def bias_residual(x: torch.Tensor, y: torch.Tensor, bias: torch.Tensor,
                  x_bias: torch.Tensor | None = None) -> torch.Tensor:
    """`(x + x_bias) + (y + bias)` of `x [B, C, T]` (may be strided), contiguous `y [B, C, T]`, biases `[C]`, each sum
    rounded as eager rounds it -> a new contiguous tensor."""
    b, c, t = y.shape
    out = torch.empty_like(y)
    block = 1024
    _bias_residual_kernel[(b * c, triton.cdiv(t, block))](x, y if x_bias is None else x_bias, y, bias, out, t, c,
                                                          *x.stride(), HAS_X_BIAS=x_bias is not None, BLOCK=block)
    return out


def conv1d_out1(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """`F.conv1d(x, weight, bias)` for one output channel: `x [B, C, T + K - 1]` (time stride 1), `weight [1, C, K]`,
    `bias [1]` -> `[B, 1, T]`."""
    b, c, n = x.shape
    k = weight.shape[-1]
    out = x.new_empty(b, 1, n - k + 1)
    if x.stride(-1) != 1:
        x = x.contiguous()
    block_t = 256
    _conv1d_out1_kernel[(b, triton.cdiv(n - k + 1, block_t))](x, weight.contiguous(), bias, out, n - k + 1,
                                                             x.stride(0), x.stride(1), CHANNELS=c, KERNEL=k,
                                                             BLOCK_T=block_t)
    return out
