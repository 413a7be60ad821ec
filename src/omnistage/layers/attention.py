"""Paged-KV attention over flat token batches.

`Attention` receives already projected, normed and rotated `q [T, H, D]`, `k/v [T, KV, D]`, writes
k/v into its paged cache (`k_cache/v_cache [num_blocks, block_size, KV, D]`, attached by
`allocate_kv_cache`) at `slot_mapping`, then attends each sequence's new tokens to its whole context
through its block table. `Attention.forward` picks the fused decode kernel, otherwise `paged_attention`
picks the backend:
- decode steps (one new token per sequence) on the fast path (CUDA): k/v written and attended in one Triton
  kernel (`triton_attention.decode_attention_with_kvcache`, cost per row's length);
- other decode steps: `paged_decode_attention`, one batched SDPA;
- prefill on CUDA in fp16/bf16 with a flash-supported head_dim: `paged_prefill_attention`, the batch's
  context K/V gathered once through `ForwardContext.kv_slots`, then one varlen flash-attention call
  (`varlen_attention`) for all sequences;
- any other prefill (CPU, fp32, tests): `paged_attention_reference`, one SDPA per sequence.
`varlen_attention_reference` is the plain-torch twin of `varlen_attention` (tests compare the two).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from omnistage.layers import triton_attention, triton_ops
from omnistage.layers.context import ForwardContext, get_context

VarlenFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int, float],
                    torch.Tensor]


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


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
                     cu_k: torch.Tensor, max_q: int, max_k: int, scale: float, causal: bool = True) -> torch.Tensor:
    """Flash-attention over packed sequences (CUDA, fp16/bf16): q [Tq, H, D], k/v [Tk, KV, D], sequence i
    at rows `cu_q[i]:cu_q[i+1]` / `cu_k[i]:cu_k[i+1]` (int32). Its queries are the LAST positions of its
    keys: flash aligns the causal mask bottom-right when q_len < k_len (asserted by the GPU test)."""
    return torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False,
                                                   scale=scale)[0]


def varlen_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
                               cu_k: torch.Tensor, max_q: int, max_k: int, scale: float) -> torch.Tensor:
    """Plain-torch `varlen_attention` (same arguments; max_q / max_k, the longest runs, only size the
    kernel's launch): one bottom-right causal SDPA per sequence (host syncs; tests)."""
    out = torch.empty_like(q)
    bq, bk = cu_q.tolist(), cu_k.tolist()
    for i in range(len(bq) - 1):
        out[bq[i]:bq[i + 1]] = _causal_sdpa(q[bq[i]:bq[i + 1]], k[bk[i]:bk[i + 1]], v[bk[i]:bk[i + 1]], scale)
    return out


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            ctx: ForwardContext, scale: float, varlen: VarlenFn = varlen_attention
                            ) -> torch.Tensor:
    """The batch's contexts packed by one gather through `ctx.kv_slots`, then one `varlen` call
    (no host sync, no per-sequence loop)."""
    k = k_cache.view(-1, *k_cache.shape[2:])[ctx.kv_slots]
    v = v_cache.view(-1, *v_cache.shape[2:])[ctx.kv_slots]
    return varlen(q, k, v, ctx.cu_seqlens_q, ctx.cu_seqlens_k, ctx.max_seqlen_q, ctx.max_seqlen_k, scale)


@functools.cache
def _flash_device(device: torch.device) -> bool:
    return (torch.backends.cuda.is_flash_attention_available()
            and torch.cuda.get_device_capability(device) >= (8, 0))


def flash_supported(q: torch.Tensor) -> bool:
    """Whether `varlen_attention` takes `q`: CUDA (sm80+, torch built with flash), fp16/bf16, head_dim a
    multiple of 8 up to 256."""
    head_dim = q.shape[-1]
    return (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and head_dim % 8 == 0 and head_dim <= 256
            and _flash_device(q.device))


def flash_prefill_supported(q: torch.Tensor, ctx: ForwardContext) -> bool:
    """`flash_supported`, and a context carrying `kv_slots` (as `build_context` makes them)."""
    return ctx.kv_slots is not None and flash_supported(q)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: ForwardContext,
                    scale: float) -> torch.Tensor:
    """Backend choice after `store_kvcache` (see the module docstring)."""
    if not ctx.is_prefill:
        return paged_decode_attention(q, k_cache, v_cache, ctx, scale)
    if flash_prefill_supported(q, ctx):
        return paged_prefill_attention(q, k_cache, v_cache, ctx, scale)
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
        if not ctx.is_prefill and triton_ops.fast_path(q):
            return triton_attention.decode_attention_with_kvcache(
                q, k, v, self.k_cache, self.v_cache, ctx.slot_mapping, ctx.block_tables, ctx.context_lens, self.scale)
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
