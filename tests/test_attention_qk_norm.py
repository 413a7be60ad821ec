"""The decode attention kernels taking RAW q/k (`qk_norm`: RMSNorm + RoPE applied in the kernel) against the two
kernels they replace (`triton_norm.rms_norm_qk`, then the kernel on normed q/k): the cache holds the same bits and
the outputs agree (bit for bit in Triton's interpreter on the CPU in fp32; on the GPU in bf16 the cache bits, the
outputs within one rounding, since the new-token scores are summed in another layout). And `DecoderAttention`
on the fast path: one attention launch and no norm launch per decode layer."""

from __future__ import annotations

import pytest
import torch
from conftest import KERNEL_DEVICE as DEV
from test_triton_attention import LENS, decode_batch

from omnistage.layers import triton_attention, triton_norm, triton_ops
from omnistage.layers.attention import allocate_kv_cache
from omnistage.layers.context import build_context, forward_context
from omnistage.layers.norm import QKNorm
from omnistage.layers.rotary import RotaryEmbedding
from omnistage.models.qwen3_omni.code_predictor import StaticKVAttention, _Lockstep
from omnistage.models.qwen3_omni.decoder import DecoderAttention, DecoderConfig

pytestmark = pytest.mark.skipif(triton_ops.triton is None, reason="needs Triton")

GPU = DEV == "cuda"
DTYPE = torch.bfloat16 if GPU else torch.float32
HEADS = [(4, 2, 32), (6, 3, 16)] + ([(32, 4, 128), (16, 2, 128)] if GPU else [])
CP_HEADS = [(4, 2, 32), (6, 2, 16)] + ([(16, 8, 128)] if GPU else [])


def _norm(d: int, positions: torch.Tensor, seed: int) -> QKNorm:
    """q/k norm weights around 1 and the RoPE rows of `positions` (views of one table, as the models read them)."""
    g = torch.Generator().manual_seed(seed)
    qw, kw = (1 + 0.2 * torch.randn(2, d, generator=g)).to(DEV, DTYPE)
    cos, sin = RotaryEmbedding(d, 1e4)(torch.arange(max(LENS), device=DEV), DTYPE)
    return QKNorm(qw, kw, 1e-6, cos[positions], sin[positions])


def _raw_qkv(rows: int, heads: int, kv: int, d: int, seed: int) -> torch.Tensor:
    """A fused qkv output `[rows, H + 2 KV, D]` with a large scale (so the norm matters)."""
    return (3 * torch.randn(rows, heads + 2 * kv, d, generator=torch.Generator().manual_seed(seed))).to(DEV, DTYPE)


def _two_kernels(qkv: torch.Tensor, heads: int, kv: int, norm: QKNorm) -> tuple[torch.Tensor, ...]:
    q, k = triton_norm.rms_norm_qk(qkv[:, :heads + kv], norm.q_weight, norm.k_weight, heads, norm.eps, norm.cos,
                                   norm.sin)
    return q, k, qkv[:, heads + kv:]


def _assert_same(out: torch.Tensor, ref: torch.Tensor, caches: torch.Tensor, ref_caches: torch.Tensor) -> None:
    assert torch.equal(caches, ref_caches)  # the normed + rotated k (and v), bit for bit
    assert out.shape == ref.shape and out.dtype == ref.dtype
    if GPU:
        torch.testing.assert_close(out, ref, rtol=2 ** -7, atol=1e-3)
    else:
        assert torch.equal(out, ref)


@pytest.mark.parametrize("heads,kv,d", HEADS)
def test_paged_decode_raw_qk_matches_two_kernels(heads: int, kv: int, d: int) -> None:
    _, _, _, k_cache, v_cache, ctx = decode_batch(heads, kv, d, d)
    rows = ctx.context_lens.shape[0]
    qkv = _raw_qkv(rows, heads, kv, d, heads)
    norm = _norm(d, ctx.context_lens.long() - 1, d)  # each row at its own position (strided table rows)
    ref_caches, caches = torch.stack([k_cache, v_cache]), torch.stack([k_cache, v_cache])
    args = (ctx.slot_mapping, ctx.block_tables, ctx.context_lens, d**-0.5)
    ref = triton_attention.decode_attention_with_kvcache(*_two_kernels(qkv, heads, kv, norm), *ref_caches, *args)
    q, k, v = qkv.split([heads, kv, kv], 1)
    out = triton_attention.decode_attention_with_kvcache(q, k, v, *caches, *args, qk_norm=norm)
    _assert_same(out, ref, caches, ref_caches)
    assert not torch.equal(caches, torch.stack([k_cache, v_cache]))  # it wrote


@pytest.mark.parametrize("heads,kv,d", CP_HEADS)
@pytest.mark.parametrize("pos,n", [(0, 2), (5, 1)])
def test_static_raw_qk_matches_two_kernels(heads: int, kv: int, d: int, pos: int, n: int) -> None:
    """The code predictor's first pass (positions 0, 1 per row: strided RoPE rows) and a later one (one position's
    row expanded over all rows: stride 0)."""
    rows, max_rows, groups = 3, 5, 16
    qkv = _raw_qkv(rows * n, heads, kv, d, pos + d)
    positions = torch.arange(pos, pos + n, device=DEV).repeat(rows)
    norm = _norm(d, positions, pos)
    if n == 1:
        norm = norm._replace(cos=norm.cos[:1].expand(rows, -1), sin=norm.sin[:1].expand(rows, -1))
        assert norm.cos.stride(0) == 0
    ref_caches = torch.randn(2, max_rows, groups, kv, d, generator=torch.Generator().manual_seed(d)).to(DEV, DTYPE)
    caches = ref_caches.clone()
    ref = triton_attention.static_attention_with_kvcache(*_two_kernels(qkv, heads, kv, norm), *ref_caches, pos, rows,
                                                         d**-0.5)
    q, k, v = qkv.split([heads, kv, kv], 1)
    out = triton_attention.static_attention_with_kvcache(q, k, v, *caches, pos, rows, d**-0.5, qk_norm=norm)
    _assert_same(out, ref, caches, ref_caches)


def _count(monkeypatch, module, name: str) -> list[int]:
    kernel, calls = getattr(module, name), [0]

    class Counting:
        def __getitem__(self, grid):
            calls[0] += 1
            return kernel[grid]

    monkeypatch.setattr(module, name, Counting())
    return calls


def _layer(head_dim: int) -> DecoderAttention:
    cfg = DecoderConfig(hidden_size=48, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=head_dim, rope_theta=1e4)
    torch.manual_seed(head_dim)
    layer = DecoderAttention(cfg).eval().requires_grad_(False)
    for p in (layer.q_norm.weight, layer.k_norm.weight):
        p.normal_(1.0, 0.2)
    layer.to(DEV, DTYPE).fuse_projections()
    allocate_kv_cache(layer, 4, 4, DTYPE, DEV)
    return layer


@torch.no_grad()
@pytest.mark.parametrize("head_dim,fused", [(16, True), (24, False)])
def test_decoder_attention_path_choice(head_dim: int, fused: bool, monkeypatch) -> None:
    """Decode steps on the fast path: the attention kernel norms q/k itself (no norm launch) where the head_dim
    allows (a power of two), else rms_norm_qk first; prefill and the reference path are as before."""
    layer = _layer(head_dim)
    x = torch.randn(2, 48, generator=torch.Generator().manual_seed(0)).to(DEV, DTYPE)
    cos, sin = RotaryEmbedding(head_dim, 1e4)(torch.tensor([5, 2], device=DEV), DTYPE)
    decode = build_context([5, 2], [1, 1], [[0, 1], [2, 3]], 4, DEV)
    outs = []
    attn_calls, norm_calls = (_count(monkeypatch, triton_attention, "_attention_with_kvcache_kernel"),
                              _count(monkeypatch, triton_norm, "_rms_norm_rope_kernel"))
    for fast in (False, True):
        monkeypatch.setattr(triton_ops, "fast_path", lambda t, fast=fast: fast)
        layer.attn.k_cache.zero_(), layer.attn.v_cache.zero_()
        with forward_context(decode):
            outs.append((layer(x, cos, sin), layer.attn.k_cache.clone()))
    assert (attn_calls[0], norm_calls[0]) == (1, 0 if fused else 1)
    torch.testing.assert_close(outs[1][0], outs[0][0], **({} if GPU else dict(rtol=1e-5, atol=1e-5)))
    torch.testing.assert_close(outs[1][1], outs[0][1], **({} if GPU else dict(rtol=1e-6, atol=1e-6)))
    with forward_context(build_context([0], [2], [[0]], 4, DEV)):  # a prefill: rms_norm_qk, no decode kernel
        layer(x, cos, sin)
    assert (attn_calls[0], norm_calls[0]) == (1, 1 if fused else 2)


@torch.no_grad()
def test_code_predictor_attention_takes_raw_qk(monkeypatch) -> None:
    """The code predictor's static attention on the fast path: one launch per layer-pass, no norm launch."""
    layer = _layer(32)
    layer.attn = StaticKVAttention(4, 2, 32, 32**-0.5, _Lockstep(0, 2))
    layer.attn.k_cache, layer.attn.v_cache = torch.zeros(2, 2, 16, 2, 32, device=DEV, dtype=DTYPE)
    x = torch.randn(4, 48, generator=torch.Generator().manual_seed(1)).to(DEV, DTYPE)
    cos, sin = RotaryEmbedding(32, 1e4)(torch.tensor([0, 1, 0, 1], device=DEV), DTYPE)
    attn_calls, norm_calls = (_count(monkeypatch, triton_attention, "_attention_with_kvcache_kernel"),
                              _count(monkeypatch, triton_norm, "_rms_norm_rope_kernel"))
    monkeypatch.setattr(triton_ops, "fast_path", lambda t: False)
    want = layer(x, cos, sin)
    monkeypatch.setattr(triton_ops, "fast_path", lambda t: True)
    got = layer(x, cos, sin)
    assert (attn_calls[0], norm_calls[0]) == (1, 0)
    torch.testing.assert_close(got, want, **({} if GPU else dict(rtol=1e-5, atol=1e-5)))
