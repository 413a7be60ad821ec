"""Generic Qwen3(-MoE) decoder on flat token batches, shared by the thinker, the talker and the code predictor.

- thinker: MoE layers without a shared expert, interleaved M-RoPE;
- talker: MoE layers with a sigmoid-gated shared expert, interleaved M-RoPE;
- code predictor: dense SwiGLU layers, 1-D RoPE (no `mrope_section`).
Every attention has q/k RMSNorm over head_dim (before RoPE) and reads the paged KV cache through the
`ForwardContext` (see `omnistage.layers.context`). Module names mirror the checkpoint's.
`fuse_projections` (CUDA, after loading) runs q/k/v, each dense gate/up and a router with its shared expert's gate
as one GEMM; `quantize_fp8` (after that) holds the projections and experts in FP8 (`layers.fp8`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from omnistage.layers.attention import Attention
from omnistage.layers.linear import linear, merge_linears, project, quantize_linears
from omnistage.layers.mlp import SwiGLUMLP
from omnistage.layers.moe import FusedExperts, SparseMoeBlock
from omnistage.layers.norm import RMSNorm, add_rms_norm, rms_norm_qk
from omnistage.layers.rotary import RotaryEmbedding


@dataclass(frozen=True)
class DecoderConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    mrope_section: tuple[int, ...] | None = None
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    vocab_size: int = 0
    intermediate_size: int = 0
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0
    mlp_only_layers: tuple[int, ...] = ()
    decoder_sparse_step: int = 1

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> DecoderConfig:
        """From a transformers text-config dict (`thinker_config.text_config`, `talker_config.text_config`,
        `talker_config.code_predictor_config`)."""
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {d['hidden_act']!r}")
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"unsupported rope_type {rope['rope_type']!r}")
        heads = d["num_attention_heads"]
        mrope = rope.get("mrope_section")
        return cls(
            hidden_size=d["hidden_size"], num_hidden_layers=d["num_hidden_layers"], num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rope_theta=rope.get("rope_theta", d.get("rope_theta", 10000.0)),
            mrope_section=tuple(mrope) if mrope else None,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6), attention_bias=d.get("attention_bias", False),
            vocab_size=d.get("vocab_size", 0), intermediate_size=d.get("intermediate_size", 0),
            num_experts=d.get("num_experts", 0), num_experts_per_tok=d.get("num_experts_per_tok", 0),
            moe_intermediate_size=d.get("moe_intermediate_size", 0), norm_topk_prob=d.get("norm_topk_prob", True),
            shared_expert_intermediate_size=d.get("shared_expert_intermediate_size") or 0,
            mlp_only_layers=tuple(d.get("mlp_only_layers") or ()), decoder_sparse_step=d.get("decoder_sparse_step", 1),
        )

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (self.num_experts > 0 and layer_idx not in self.mlp_only_layers
                and (layer_idx + 1) % self.decoder_sparse_step == 0)


class Deepstack(NamedTuple):
    """Visual DeepStack rows: `embeds[i]` ([N, H]) is added at flat token rows `index` ([N]) after layer i."""

    index: torch.Tensor
    embeds: Sequence[torch.Tensor]


class DecoderAttention(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        h, nh, kv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.head_dim, self.num_heads, self.num_kv_heads = hd, nh, kv
        self.q_proj = nn.Linear(h, nh * hd, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(h, kv * hd, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(h, kv * hd, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(nh * hd, h, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.attn = Attention(nh, kv, hd, hd**-0.5)
        self.qkv_weight: torch.Tensor | None = None
        self.qkv_bias: torch.Tensor | None = None
        self.qkv_scale: torch.Tensor | None = None

    def fuse_projections(self) -> None:
        """q/k/v as one GEMM (their weights become views into `qkv_weight`)."""
        self.qkv_weight, self.qkv_bias = merge_linears([self.q_proj, self.k_proj, self.v_proj])

    def quantize_fp8(self) -> None:
        """q/k/v (once fused, `qkv_weight` per row) and o_proj in FP8 (`layers.linear.Fp8Linear`)."""
        self.qkv_weight, self.qkv_scale = quantize_linears(self, ["q_proj", "k_proj", "v_proj"], self.qkv_weight)
        quantize_linears(self, ["o_proj"], None)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = self._qkv(x, cos, sin) if self.qkv_weight is None else self._qkv_fused(x, cos, sin)
        return project(self.attn(q, k, v).flatten(1), self.o_proj)

    def _qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        t = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(t, -1, self.head_dim), cos, sin)
        k = self.k_norm(self.k_proj(x).view(t, -1, self.head_dim), cos, sin)
        return q, k, self.v_proj(x).view(t, -1, self.head_dim)

    def _qkv_fused(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """One GEMM; q/k normed straight from its output, v a strided view of it (no copies)."""
        qkv = linear(x, self.qkv_weight, self.qkv_bias, self.qkv_scale).view(x.shape[0], -1, self.head_dim)
        nqk = self.num_heads + self.num_kv_heads
        q, k = rms_norm_qk(qkv[:, :nqk], self.q_norm.weight, self.k_norm.weight, self.num_heads,
                           self.q_norm.eps, cos, sin)
        return q, k, qkv[:, nqk:]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = DecoderAttention(cfg)
        if cfg.is_moe_layer(layer_idx):
            self.mlp: nn.Module = SparseMoeBlock(
                cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
                cfg.norm_topk_prob, cfg.shared_expert_intermediate_size)
        else:
            self.mlp = SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """vLLM-style: `h` is the previous layer's MLP output, `residual` the stream it is added to (None: `h` is
        the stream) -> (this MLP's output, the stream before it); each add is fused with the norm after it."""
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        h, residual = add_rms_norm(h, residual, norm1.weight, norm1.eps)
        h, residual = add_rms_norm(self.self_attn(h, cos, sin), residual, norm2.weight, norm2.eps)
        return self.mlp(h), residual


class DecoderModel(nn.Module):
    """`layers` + final `norm` (+ RoPE tables); subclasses add their embeddings."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.config = cfg
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.mrope_section)

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor | None, capture_layer: int | None = None,
                deepstack: Deepstack | None = None, rope: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Flat `inputs_embeds [T, H]`, `positions [T]` or `[3, T]` -> (final hidden after `norm`, captured).

        `captured` is transformers' `hidden_states[capture_layer]`: 0 = the inputs, i = the output of
        layer i-1 (before any DeepStack addition), num_layers = the final normed hidden (transformers
        puts the normed state last). `rope`: the tokens' (cos, sin) `[T, head_dim // 2]` from `rotary_emb`,
        computed once by the caller (then `positions` is not read)."""
        cos, sin = rope if rope is not None else self.rotary_emb(positions, inputs_embeds.dtype)
        h, residual = inputs_embeds, None
        captured = h if capture_layer == 0 else None
        for i, layer in enumerate(self.layers):
            h, residual = layer(h, residual, cos, sin)
            adds_deepstack = deepstack is not None and i < len(deepstack.embeds)
            if capture_layer == i + 1 or adds_deepstack:
                h, residual = residual + h, None  # NOTE: the layer's output, added as before where it is read
                captured = h if capture_layer == i + 1 else captured
            if adds_deepstack:
                h = h.index_add(0, deepstack.index, deepstack.embeds[i].to(h.dtype))
        h, _ = add_rms_norm(h, residual, self.norm.weight, self.norm.eps)
        return h, (h if capture_layer == len(self.layers) else captured)


def fuse_projections(module: nn.Module) -> None:
    """The fast path's merged GEMMs: q/k/v of every decoder attention, gate/up of every dense SwiGLU and the
    router with the shared expert's gate of every MoE block that has one in `module` run as one GEMM each. The
    per-projection weights become views into the merged ones, so no second copy is held and module and parameter
    names stay the checkpoint's (loading later still works).
    NOTE: call once the module is on its device and dtype (`layers.linear.merge_linears`)."""
    for m in module.modules():
        if isinstance(m, (DecoderAttention, SwiGLUMLP, SparseMoeBlock)):
            m.fuse_projections()


def quantize_fp8(module: nn.Module, dense: bool = False) -> None:
    """`--quantization fp8`: the routed experts in `module` held in FP8 with per-row scales (the bytes: 29.0 of the
    thinker's 31.7 B parameters); with `dense` (`fp8-all`) also every decoder attention's q/k/v/o and dense SwiGLU
    (the code predictor's layers, the talker's shared expert). Embeddings, norms, routers (and the shared expert's
    gate), heads and everything outside the decoders stay as they are.
    NOTE: after `fuse_projections` (merged weights are quantised as one), never before it."""
    kinds = (DecoderAttention, SwiGLUMLP, FusedExperts) if dense else (FusedExperts,)
    for m in list(module.modules()):
        if isinstance(m, kinds):
            m.quantize_fp8()
