"""The encoders' attention over packed sequences (the audio tower's windows, the vision encoder's images and
frames), for our encoder forwards (`audio_encoder.py`, `vision_encoder.py`).

On the CUDA fast path it is one flash-attention call for all sequences of a layer (`layers.attention.
varlen_attention`, not causal); otherwise transformers' own SDPA, one call per sequence, exactly as
transformers runs these encoders with `sdpa` (the reference path).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from omnistage.layers import triton_ops
from omnistage.layers.attention import flash_supported, varlen_attention


def packed_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     cu_seqlens: torch.Tensor, longest: int, scaling: float) -> torch.Tensor:
    """`query` / `key` / `value` `[1, heads, N, head_dim]` (transformers' layout) of sequences packed along N,
    boundaries `cu_seqlens` (int32, on their device; empty sequences allowed), the longest `longest` rows (at
    least) -> `[N, heads, head_dim]`."""
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    if triton_ops.fast_path(q) and flash_supported(q):
        return varlen_attention(q, k, v, cu_seqlens, cu_seqlens, longest, longest, scaling, causal=False)
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    parts = [sdpa_attention_forward(module, q, k, v, None, scaling=scaling, dropout=0.0, is_causal=False)[0]
             for q, k, v in zip(*(t.split(lengths, dim=2) for t in (query, key, value))) if q.shape[2]]
    return torch.cat(parts, dim=1)[0]
