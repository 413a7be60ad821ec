"""Causal convolution blocks of Code2Wav (upsampler and waveform decoder).

Every layer runs one-shot (`ctx=None`: zero left padding, as transformers does) or as one chunk of a
stream (`ctx`: a `StreamContext` that supplies and keeps the layer's left context per request).
A layer whose output needs past inputs declares `state_shape` (per request, time last); the stream
cache allocates one buffer of that shape per request for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from omnistage.models.qwen3_omni import code2wav_fused

if TYPE_CHECKING:
    from omnistage.models.qwen3_omni.code2wav_stream import StreamContext


class CausalConv1d(nn.Module):
    """Stride-1 conv whose output at t sees inputs t - (k-1)*dilation .. t."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, dilation: int = 1,
                 groups: int = 1):
        super().__init__()
        self.conv = nn.Conv1d(in_channels, out_channels, kernel_size, dilation=dilation, groups=groups)
        self.context = (kernel_size - 1) * dilation
        self.state_shape = (in_channels, self.context) if self.context else None

    def forward(self, x: torch.Tensor, ctx: StreamContext | None = None) -> torch.Tensor:
        if self.context:
            x = F.pad(x, (self.context, 0)) if ctx is None else ctx.extend(self, x)
        return self.conv(x)

    def left_context(self, ctx: StreamContext | None) -> int:
        """Inputs prepended to a chunk's: the saved ones in a stream, zeros one-shot."""
        return self.context


class CausalTransConv1d(nn.Module):
    """ConvTranspose1d(k, s) trimmed by p = k - s on both sides: T inputs give T*s - p samples.

    Output sample m is y_full[m + p]; y_full[j] needs inputs up to j // s, so after T inputs the
    samples below T*s - p are final and the rest need the next input. A stream chunk of n inputs
    therefore emits n*s samples (the first chunk n*s - p), computed from the n inputs plus the last
    ceil(p / s) inputs of the previous chunk.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int):
        super().__init__()
        self.conv = nn.ConvTranspose1d(in_channels, out_channels, kernel_size, stride=stride)
        self.stride = stride
        self.trim = kernel_size - stride
        context = -(-self.trim // stride)
        self.state_shape = (in_channels, context) if context else None

    def forward(self, x: torch.Tensor, ctx: StreamContext | None = None) -> torch.Tensor:
        n = x.shape[-1]
        if self.left_context(ctx):
            x = ctx.extend(self, x)
        return self.final_samples(self.conv(x), x.shape[-1] - n, n, ctx)

    def left_context(self, ctx: StreamContext | None) -> int:
        """Inputs prepended to a chunk's: the saved ones in a stream, none one-shot."""
        return self.state_shape[-1] if ctx is not None and self.state_shape else 0

    def final_samples(self, y: torch.Tensor, used: int, n: int, ctx: StreamContext | None) -> torch.Tensor:
        """The final samples of the untrimmed output `y` over `used` saved and `n` new inputs."""
        first = ctx is None or ctx.first
        start = used * self.stride + (self.trim if first else 0)
        return y[..., start:(used + n) * self.stride]


class SnakeBeta(nn.Module):
    """x + sin(x * e^alpha)^2 / (e^beta + 1e-9), per channel; input [B, C, T]. On CUDA the decoder runs it fused
    into its neighbours (`code2wav_fused`)."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha = self.alpha.exp()[:, None]
        beta = self.beta.exp()[:, None]
        return x + (1.0 / (beta + 1e-9)) * torch.sin(x * alpha).pow(2)


class ConvNeXtBlock(nn.Module):
    """Causal depthwise conv (k7), LayerNorm, 4x GELU MLP, per-channel gamma, residual."""

    def __init__(self, dim: int):
        super().__init__()
        self.dwconv = CausalConv1d(dim, dim, 7, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 1e-6))

    def forward(self, x: torch.Tensor, ctx: StreamContext | None = None) -> torch.Tensor:
        h = self.norm(self.dwconv(x, ctx).transpose(1, 2))
        h = self.gamma * self.pwconv2(self.act(self.pwconv1(h)))
        return x + h.transpose(1, 2)


class DecoderResidualUnit(nn.Module):
    def __init__(self, dim: int, dilation: int):
        super().__init__()
        self.act1 = SnakeBeta(dim)
        self.conv1 = CausalConv1d(dim, dim, 7, dilation=dilation)
        self.act2 = SnakeBeta(dim)
        self.conv2 = CausalConv1d(dim, dim, 1)

    def forward(self, x: torch.Tensor, ctx: StreamContext | None = None) -> torch.Tensor:
        return x + self.conv2(self.act2(self.conv1(self.act1(x), ctx)), ctx)


class DecoderBlock(nn.Module):
    """SnakeBeta, causal transposed conv (x`rate`, halves channels), residual units dilated 1, 3, 9."""

    def __init__(self, in_dim: int, rate: int):
        super().__init__()
        out_dim = in_dim // 2
        units = [DecoderResidualUnit(out_dim, d) for d in (1, 3, 9)]
        upsample = CausalTransConv1d(in_dim, out_dim, 2 * rate, rate)
        self.block = nn.ModuleList([SnakeBeta(in_dim), upsample, *units])

    def forward(self, x: torch.Tensor, ctx: StreamContext | None = None) -> torch.Tensor:
        if code2wav_fused.enabled(x, self):
            return code2wav_fused.decoder_block(self, x, ctx)
        act, upsample, *units = self.block
        x = upsample(act(x), ctx)
        for unit in units:
            x = unit(x, ctx)
        return x
