"""Paged-KV attention over flat token batches.

`Attention` receives already projected, normed and rotated `q [T, H, D]`, `k/v [T, KV, D]`, writes
k/v into its paged cache (`k_cache/v_cache [num_blocks, block_size, KV, D]`, attached by
`allocate_kv_cache`) at `slot_mapping`, then attends each sequence's new tokens to its whole context
through its block table. `paged_attention` is the ONE place that picks the backend.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from omnistage.layers.context import ForwardContext, get_context


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """Write new k/v `[T, KV, D]` into their slots (no host sync; CUDA-graph capturable)."""
    k_cache.view(-1, *k.shape[1:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v.shape[1:]).index_copy_(0, slot_mapping, v)


def _causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [Lq, H, D] are the last Lq positions of a context k/v [Lk, KV, D]; GQA by head repetition."""
    lq, lk = q.shape[0], k.shape[0]
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1).transpose(0, 1)
    v = v.repeat_interleave(rep, dim=1).transpose(0, 1)
    keep = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(diagonal=lk - lq)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=keep, scale=scale)
    return out.transpose(0, 1)


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              ctx: ForwardContext, scale: float) -> torch.Tensor:
    """Plain-torch paged attention: gather each sequence's blocks, causal SDPA (host syncs; tests / CPU)."""
    out = torch.empty_like(q)
    block_size = k_cache.shape[1]
    cu_q = ctx.cu_seqlens_q.tolist()
    for i, kv_len in enumerate(ctx.context_lens.tolist()):
        blocks = ctx.block_tables[i, :-(-kv_len // block_size)].long()
        k = k_cache[blocks].flatten(0, 1)[:kv_len]
        v = v_cache[blocks].flatten(0, 1)[:kv_len]
        out[cu_q[i]:cu_q[i + 1]] = _causal_sdpa(q[cu_q[i]:cu_q[i + 1]], k, v, scale)
    return out


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: ForwardContext,
                           scale: float) -> torch.Tensor:
    """One new token per sequence, all sequences in one SDPA: each gathers its blocks up to the
    batch's longest context, the rest masked. No host sync; fixed shapes for a given `max_seqlen_k`."""
    width = -(-ctx.max_seqlen_k // k_cache.shape[1])
    tables = ctx.block_tables[:, :width].long()
    k = k_cache[tables].flatten(1, 2).transpose(1, 2)  # [B, KV, L, D]
    v = v_cache[tables].flatten(1, 2).transpose(1, 2)
    keep = torch.arange(k.shape[2], device=q.device)[None, :] < ctx.context_lens[:, None]
    out = F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=keep[:, None, None], scale=scale,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return out[:, :, 0]


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: ForwardContext,
                    scale: float) -> torch.Tensor:
    """Backend choice: batched decode for decode steps, the per-sequence reference for prefill.
    NOTE: a CUDA kernel whose decode cost follows each sequence's real length plugs in here."""
    if not ctx.is_prefill:
        return paged_decode_attention(q, k_cache, v_cache, ctx, scale)
    return paged_attention_reference(q, k_cache, v_cache, ctx, scale)


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.k_cache = self.v_cache = torch.tensor([])

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.k_cache.numel() == 0:
            raise RuntimeError("no KV cache attached: call allocate_kv_cache(model, ...) first")
        ctx = get_context()
        store_kvcache(k, v, self.k_cache, self.v_cache, ctx.slot_mapping)
        return paged_attention(q, self.k_cache, self.v_cache, ctx, self.scale)


def allocate_kv_cache(model: nn.Module, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device | str) -> torch.Tensor:
    """Attach a zeroed paged cache to every `Attention` of `model`; returns the one backing tensor
    `[2, num_layers, num_blocks, block_size, KV, D]` (layers in module order)."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    if not layers:
        raise ValueError("model has no Attention layers")
    shapes = {(m.num_kv_heads, m.head_dim) for m in layers}
    if len(shapes) != 1:
        raise ValueError(f"attention layers disagree on (kv_heads, head_dim): {shapes}")
    kv, hd = shapes.pop()
    cache = torch.zeros(2, len(layers), num_blocks, block_size, kv, hd, dtype=dtype, device=device)
    for i, m in enumerate(layers):
        m.k_cache, m.v_cache = cache[0, i], cache[1, i]
    return cache
