"""Code2Wav: 16-codebook codec frames -> 24 kHz waveform (1920 samples per frame).

Embedding mean over codebooks -> sliding-window causal transformer -> 4x ConvNeXt upsampler ->
causal conv decoder (x480) -> clamp. Parameter names equal transformers' `Qwen3OmniMoeCode2Wav`.
`forward(codes)` is the one-shot decode; `forward(codes, ctx)` decodes one chunk of a stream
(see `code2wav_stream.py`): the concatenated chunks equal the one-shot decode.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from omnistage.layers.mlp import SwiGLUMLP
from omnistage.layers.norm import RMSNorm
from omnistage.layers.rotary import RotaryEmbedding, apply_rotary_emb
from omnistage.models.qwen3_omni import code2wav_fused
from omnistage.models.qwen3_omni.code2wav_conv import CausalConv1d, CausalTransConv1d, ConvNeXtBlock, \
    DecoderBlock, SnakeBeta

if TYPE_CHECKING:
    from omnistage.models.qwen3_omni.code2wav_stream import StreamContext


class Code2WavAttention(nn.Module):
    """Causal attention over the last `sliding_window` frames (the query's own frame included)."""

    def __init__(self, config):
        super().__init__()
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        heads, kv_heads, bias = config.num_attention_heads, config.num_key_value_heads, config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * self.head_dim, config.hidden_size, bias=bias)
        # stream state: RoPE'd keys and values of the previous window-1 frames
        self.state_shape = (2, kv_heads, config.sliding_window - 1, self.head_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                ctx: StreamContext | None) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = (proj(x).view(b * n, -1, self.head_dim) for proj in (self.q_proj, self.k_proj, self.v_proj))
        q = apply_rotary_emb(q, cos, sin).view(b, n, -1, self.head_dim).transpose(1, 2)
        k = apply_rotary_emb(k, cos, sin).view(b, n, -1, self.head_dim)
        kv = torch.stack((k, v.view(b, n, -1, self.head_dim)), dim=1).transpose(2, 3)
        if ctx is not None:
            kv = ctx.extend(self, kv, dim=-2)
        out = F.scaled_dot_product_attention(q, kv[:, 0], kv[:, 1], attn_mask=mask, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))


class LayerScale(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.scale = nn.Parameter(torch.full((config.hidden_size,), config.layer_scale_initial_scale))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x


class Code2WavDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = Code2WavAttention(config)
        self.mlp = SwiGLUMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn_layer_scale = LayerScale(config)
        self.mlp_layer_scale = LayerScale(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                ctx: StreamContext | None) -> torch.Tensor:
        x = x + self.self_attn_layer_scale(self.self_attn(self.input_layernorm(x), cos, sin, mask, ctx))
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))


class Code2WavTransformer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList(Code2WavDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.window = config.sliding_window
        head_dim = self.layers[0].self_attn.head_dim
        self.rotary_emb = RotaryEmbedding(head_dim, config.rope_parameters["rope_theta"])

    def _positions(self, b: int, n: int, ctx: StreamContext | None, device: torch.device):
        """Absolute frame positions of queries [B, n] and keys [B, L] (past window slots first)."""
        q_pos = torch.arange(n, device=device).expand(b, n)
        if ctx is None:
            return q_pos, q_pos
        q_pos = ctx.pos[:, None] + q_pos
        past = ctx.pos[:, None] + torch.arange(1 - self.window, 0, device=device)
        return q_pos, torch.cat((past, q_pos), dim=1)

    def forward(self, x: torch.Tensor, ctx: StreamContext | None = None) -> torch.Tensor:
        q_pos, k_pos = self._positions(*x.shape[:2], ctx, x.device)
        cos, sin = self.rotary_emb(q_pos.flatten(), x.dtype)
        dist = q_pos[:, :, None] - k_pos[:, None, :]
        mask = ((dist >= 0) & (dist < self.window) & (k_pos[:, None, :] >= 0))[:, None]
        for layer in self.layers:
            x = layer(x, cos, sin, mask, ctx)
        return self.norm(x)


class Code2Wav(nn.Module):
    """Codec frames [B, Q, T] -> waveform [B, 1, T*1920 - 555] (for the real upsample rates)."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        hidden, dim = config.hidden_size, config.decoder_dim
        self.pre_transformer = Code2WavTransformer(config)
        self.code_embedding = nn.Embedding(config.codebook_size * config.num_quantizers, hidden)
        offset = torch.arange(config.num_quantizers).view(1, -1, 1) * config.codebook_size
        self.register_buffer("code_offset", offset, persistent=False)
        self.upsample = nn.ModuleList(
            nn.ModuleList([CausalTransConv1d(hidden, hidden, f, f), ConvNeXtBlock(hidden)])
            for f in config.upsampling_ratios)
        blocks = [DecoderBlock(dim // 2**i, rate) for i, rate in enumerate(config.upsample_rates)]
        out_dim = dim // 2 ** len(config.upsample_rates)
        self.decoder = nn.ModuleList([CausalConv1d(hidden, dim, 7), *blocks, SnakeBeta(out_dim),
                                      CausalConv1d(out_dim, 1, 7)])

    def forward(self, codes: torch.Tensor, ctx: StreamContext | None = None) -> torch.Tensor:
        if codes.shape[1] != self.config.num_quantizers:
            raise ValueError(f"expected {self.config.num_quantizers} codebooks, got {codes.shape[1]}")
        x = self.code_embedding(codes + self.code_offset).mean(1)
        x = self.pre_transformer(x, ctx).transpose(1, 2)
        for upsample, convnext in self.upsample:
            x = convnext(upsample(x, ctx), ctx)
        first, *blocks, act, last = self.decoder
        x = code2wav_fused.first_conv(first, x, ctx) if code2wav_fused.enabled(x, first) else first(x, ctx)
        for block in blocks:
            x = block(x, ctx)
        x = code2wav_fused.output(act, last, x, ctx) if code2wav_fused.enabled(x, act) else last(act(x), ctx)
        return x.clamp(-1, 1)
