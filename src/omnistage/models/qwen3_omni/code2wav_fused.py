"""Code2Wav's waveform decoder on the CUDA fast path: `DecoderBlock.forward` and `Code2Wav.forward` pick it.

The same convolutions as the reference path (cuDNN), without the full-tensor passes around them:
- each conv runs without its bias, which the next kernel adds where it reads the output (torch's cuDNN path adds a
  bias in a separate in-place pass over the output);
- a SnakeBeta that feeds a causal conv writes into that conv's input buffer after the saved context columns,
  instead of a `torch.cat` of the context and its output;
- a transposed conv's trimmed output is read in place (strided), not copied;
- the last conv (C -> 1 channel) is a direct Triton conv (`triton_conv.conv1d_out1`);
- the first (hidden -> decoder_dim over a chunk's few frames) is one GEMM over unfolded windows;
- a residual conv at a shape where cuDNN is slow (`DIRECT_CONVS`) runs as a Triton implicit GEMM (`triton_conv.conv1d`).
Every sum is rounded where the reference rounds it, so only the convs' accumulation order differs.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from omnistage.layers import triton_conv, triton_ops

if TYPE_CHECKING:
    from omnistage.models.qwen3_omni.code2wav_conv import CausalConv1d, CausalTransConv1d, DecoderBlock, \
        DecoderResidualUnit, SnakeBeta
    from omnistage.models.qwen3_omni.code2wav_stream import StreamContext


def enabled(x: torch.Tensor, module: nn.Module) -> bool:
    """The fast path for `module` on `x`: CUDA, fused kernels on, weights in x's dtype."""
    return triton_ops.fast_path(x) and next(module.parameters()).dtype == x.dtype


def activated_input(act: SnakeBeta, x: torch.Tensor, layer: CausalConv1d | CausalTransConv1d,
                    ctx: StreamContext | None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`layer`'s input for `act(x + bias)`: its left context (saved, or zeros one-shot), then the activation
    [B, C, left + T]; the tail is saved as the next chunk's context."""
    b, c, t = x.shape
    left = layer.left_context(ctx)
    h = x.new_empty(b, c, left + t)
    if left and ctx is None:
        h[..., :left].zero_()
    elif left:
        h[..., :left].copy_(ctx.past(layer))
    triton_ops.snake_beta(x, act.alpha, act.beta, bias, out=h[..., left:])
    if left and ctx is not None:
        ctx.save(layer, h)
    return h


# Residual convs that run as `triton_conv.conv1d`: (in channels, kernel, dilation) -> the (batch, output length)s
# where cuDNN picks its generic kernel, 6.5-11x slower than Triton's there (H100, `scripts/conv_bench.py` over chunks
# of 4 and 25 frames at batch 1-16 and 64, HISTORY 47); cuDNN keeps the rest, where Triton takes 0.8-1.9x its time.
# A frame is 640 samples at 192 channels, 160 at 384.
DIRECT_CONVS: dict[tuple[int, int, int], frozenset[tuple[int, int]]] = {} \
    if os.environ.get("OMNISTAGE_DIRECT_CONVS") == "0" else {
        (192, 7, 3): frozenset({(8, 2560), (16, 2560), (1, 16000), (2, 16000)}),
        (192, 7, 9): frozenset({(8, 2560), (16, 2560), (1, 16000), (2, 16000)}),
        (384, 7, 3): frozenset({(8, 640)}),
        (384, 7, 9): frozenset({(8, 640), (8, 4000), (16, 4000), (64, 4000)})}


def direct(layer: CausalConv1d, h: torch.Tensor) -> bool:
    """Whether `layer`'s conv of its extended input `h` runs as `triton_conv.conv1d` (`DIRECT_CONVS`)."""
    c = layer.conv
    return (h.shape[0], h.shape[-1] - layer.context) in DIRECT_CONVS.get(
        (c.in_channels, c.kernel_size[0], c.dilation[0]), ())


def conv(layer: CausalConv1d, h: torch.Tensor) -> torch.Tensor:
    """`layer`'s conv of its (already extended) input without the bias."""
    c = layer.conv
    if direct(layer, h):
        return triton_conv.conv1d(h, c.weight, c.dilation[0])
    return F.conv1d(h, c.weight, None, c.stride, 0, c.dilation, c.groups)


def residual_unit(unit: DecoderResidualUnit, x: torch.Tensor, x_bias: torch.Tensor | None,
                  ctx: StreamContext | None) -> torch.Tensor:
    """`unit(x + x_bias)`; `x` may be strided, the result is contiguous."""
    h = conv(unit.conv1, activated_input(unit.act1, x, unit.conv1, ctx, x_bias))
    h = triton_ops.snake_beta(h, unit.act2.alpha, unit.act2.beta, unit.conv1.conv.bias)
    # NOTE: conv2 has kernel 1 (no context to extend or save)
    return triton_conv.bias_residual(x, conv(unit.conv2, h), unit.conv2.conv.bias, x_bias)


def decoder_block(block: DecoderBlock, x: torch.Tensor, ctx: StreamContext | None) -> torch.Tensor:
    """`block(x)`: [B, C, T] -> [B, C / 2, T * rate] (a stream's first chunk: minus the trim)."""
    act, up, *units = block.block
    h = activated_input(act, x, up, ctx)
    y = F.conv_transpose1d(h, up.conv.weight, None, up.stride)
    x = up.final_samples(y, h.shape[-1] - x.shape[-1], x.shape[-1], ctx)
    x_bias = up.conv.bias  # NOTE: the transposed conv's bias: the first unit adds it where it reads x
    for unit in units:
        x, x_bias = residual_unit(unit, x, x_bias, ctx), None
    return x


def first_conv(first: CausalConv1d, x: torch.Tensor, ctx: StreamContext | None) -> torch.Tensor:
    """`first(x)` (hidden -> decoder_dim, kernel 7, stride and dilation 1, over a chunk's few upsampled frames) as
    one GEMM over the unfolded windows (H200, against cuDNN: a 25-frame chunk at batch 16 16.3 -> 16.0 ms, a 2-frame
    first chunk at batch 64 9.7 -> 9.4 ms). [B, C, T] -> [B, C', T] (a transposed view)."""
    h = F.pad(x, (first.context, 0)) if ctx is None else ctx.extend(first, x)
    c = first.conv
    b, t = h.shape[0], h.shape[-1] - first.context
    windows = h.unfold(2, c.kernel_size[0], 1).transpose(1, 2).reshape(b * t, -1)  # [B * T, C * k], (c, tap) order
    return F.linear(windows, c.weight.flatten(1), c.bias).view(b, t, -1).transpose(1, 2)


def output(act: SnakeBeta, last: CausalConv1d, x: torch.Tensor, ctx: StreamContext | None) -> torch.Tensor:
    """`last(act(x))` of the decoder's last level: [B, C, T] -> [B, 1, T]."""
    return triton_conv.conv1d_out1(activated_input(act, x, last, ctx), last.conv.weight, last.conv.bias)
