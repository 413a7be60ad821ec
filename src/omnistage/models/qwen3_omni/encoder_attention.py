"""The encoders' attention over packed sequences (the audio tower's windows, the vision encoder's images and
frames), plugged into transformers' encoder classes through its attention interface (`use_packed_attention`).

On the CUDA fast path it is one flash-attention call for all sequences of a layer (`layers.attention.
varlen_attention`, not causal); otherwise transformers' own SDPA, one call per sequence, exactly as
transformers runs these encoders with `sdpa` (the reference path).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from omnistage.layers import triton_ops
from omnistage.layers.attention import flash_supported, varlen_attention

# NOTE: transformers' encoders take their packed path (cu_seqlens, no per-sequence loop, no host sync per
# layer) only for an attention implementation whose name contains "flash".
NAME = "omnistage_flash_packed"


def packed_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     cu_seq_lens_q: torch.Tensor | None = None, cu_seq_lens_k: torch.Tensor | None = None,
                     max_length_q: int | None = None, max_length_k: int | None = None,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """`query` / `key` / `value` `[1, heads, N, head_dim]` of sequences packed along N (boundaries
    `cu_seq_lens_q`) -> `[N, heads, head_dim]`."""
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    if triton_ops.fast_path(q) and flash_supported(q):
        cu_q, cu_k = cu_seq_lens_q.to(torch.int32), cu_seq_lens_k.to(torch.int32)
        return varlen_attention(q, k, v, cu_q, cu_k, int(max_length_q), int(max_length_k), scaling,
                                causal=False), None
    lengths = (cu_seq_lens_q[1:] - cu_seq_lens_q[:-1]).tolist()
    parts = [sdpa_attention_forward(module, q, k, v, None, scaling=scaling, dropout=0.0, is_causal=False)[0]
             for q, k, v in zip(*(t.split(lengths, dim=2) for t in (query, key, value)))]
    return torch.cat(parts, dim=1)[0], None


AttentionInterface.register(NAME, packed_attention)


def use_packed_attention(encoder: nn.Module) -> nn.Module:
    """Route `encoder`'s attention (a transformers audio or vision encoder) through `packed_attention`."""
    encoder.config._attn_implementation = NAME
    return encoder
