"""Code2wav decoder kernels (Triton) for the CUDA fast path (`models.qwen3_omni.code2wav_fused` calls them).

- `bias_residual(x, y, bias, x_bias)`: a residual unit's `x + conv2(...)` with conv2's bias add folded in (and the
  bias of a transposed conv whose trimmed, strided output `x` is), rounded where eager rounds: one pass instead of
  cuDNN's separate in-place bias add plus the add.
- `conv1d_out1(x, weight, bias)`: the decoder's last conv (C -> 1 channel, kernel K, no padding) as a direct conv
  with fp32 accumulation, one read of the input and no cuDNN layout change of its [B, C, T] input.
- `conv1d(x, weight, dilation)`: a stride-1 conv without bias as an implicit GEMM over [B, C, T] as it lies (the
  reduction runs over (channel, tap) pairs in the weight's own flattened order): no unfolded windows, no layout
  change, and no generic kernel for the dilations that cuDNN has no fast one for.
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

    @triton.jit
    def _conv1d_kernel(x_ptr, w_ptr, out_ptr, c_out, length, reduce, sxb, sxc, DILATION: tl.constexpr,
                       KERNEL: tl.constexpr, BLOCK_CO: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr,
                       IEEE: tl.constexpr):
        co = tl.program_id(0) * BLOCK_CO + tl.arange(0, BLOCK_CO)  # NOTE: output channels fastest: x tiles reused
        t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
        b = tl.program_id(2).to(tl.int64)
        acc = tl.zeros([BLOCK_CO, BLOCK_T], dtype=tl.float32)
        for r0 in range(0, reduce, BLOCK_R):
            r = r0 + tl.arange(0, BLOCK_R)  # (channel, tap) = divmod(r, KERNEL), as weight.flatten(1) orders them
            rm = r < reduce
            w = tl.load(w_ptr + co[:, None] * reduce + r[None, :], mask=(co[:, None] < c_out) & rm[None, :], other=0.0)
            x_row = (r // KERNEL).to(tl.int64) * sxc + (r % KERNEL) * DILATION
            x = tl.load(x_ptr + b * sxb + x_row[:, None] + t[None, :], mask=rm[:, None] & (t[None, :] < length),
                        other=0.0)
            if IEEE:
                acc = tl.dot(w, x, acc, input_precision="ieee")
            else:
                acc = tl.dot(w, x, acc)
        out = out_ptr + (b * c_out + co[:, None]) * length + t[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(co[:, None] < c_out) & (t[None, :] < length))


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


# (BLOCK_CO, BLOCK_T, BLOCK_R, num_warps, num_stages): the best of 8 for code2wav's dilated convs at batch 16 / 64
# (H100, `scripts/conv_bench.py`; the 384-channel dilation-9 one 0.68 ms against 1.23 with 128 x 128 tiles)
CONV_TILES = (64, 128, 64, 4, 3)


def conv1d(x: torch.Tensor, weight: torch.Tensor, dilation: int, tiles: tuple[int, ...] = CONV_TILES) -> torch.Tensor:
    """`F.conv1d(x, weight, dilation=dilation)` (stride 1, no padding, no bias, groups 1): `x [B, C, T + (K - 1) *
    dilation]` (time stride 1; batch and channel strides free), `weight [C', C, K]` -> contiguous `[B, C', T]`;
    fp32 accumulation, one rounding to x's dtype."""
    b, c, n = x.shape
    c_out, _, k = weight.shape
    length = n - (k - 1) * dilation
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = x.new_empty(b, c_out, length)
    block_co, block_t, block_r, warps, stages = tiles
    grid = (triton.cdiv(c_out, block_co), triton.cdiv(length, block_t), b)
    _conv1d_kernel[grid](x, weight.contiguous(), out, c_out, length, c * k, x.stride(0), x.stride(1),
                         DILATION=dilation, KERNEL=k, BLOCK_CO=block_co, BLOCK_T=block_t, BLOCK_R=block_r,
                         IEEE=x.dtype == torch.float32, num_warps=warps, num_stages=stages)
    return out
