"""Code predictor ("MTP"): codebooks 1..G-1 of a codec frame from the talker's hidden and codebook 0.

A dense Qwen3 decoder run G-1 times per frame: a 2-position prefill [talker hidden, C(c0)] -> lm_head[0]
-> c1, then one position per pass, pass g feeding codec_embedding[g-1](c_g) -> lm_head[g] -> c_{g+1}.
All rows of a batch are at the same position in lockstep and the context is <= G positions, so the
attention reads a preallocated per-row cache [rows, G, KV, D] (no paged-cache metadata): every pass has
fixed shapes and the whole `predict` loop is one CUDA-graph candidate (no host syncs). Each frame
overwrites the cache from position 0, and a pass only reads positions it wrote this frame. For the same
reason the RoPE tables of positions 0..G-1 are computed once (`allocate_cache`): a pass reads views of them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from omnistage.layers import triton_attention, triton_ops
from omnistage.layers.linear import linear
from omnistage.layers.sampling import SamplingTensors, sample
from omnistage.models.qwen3_omni.decoder import DecoderConfig, DecoderModel

CP_TOP_K, CP_TOP_P = 50, 0.8  # hard-coded in transformers' talker when it samples


@dataclass
class _Lockstep:
    """Where the current pass writes: `pos` (first position), `rows` (batch rows in use)."""

    pos: int = 0
    rows: int = 0


class StaticKVAttention(nn.Module):
    """Attention core (same call as `layers.attention.Attention`) over a small per-row static cache."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, step: _Lockstep) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.step = step
        self.k_cache = self.v_cache = torch.tensor([])

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        p, b = self.step.pos, self.step.rows
        n = q.shape[0] // b
        if triton_ops.fast_path(q):
            return triton_attention.static_attention_with_kvcache(q, k, v, self.k_cache, self.v_cache, p, b, self.scale)
        self.k_cache[:b, p:p + n] = k.view(b, n, self.num_kv_heads, self.head_dim)
        self.v_cache[:b, p:p + n] = v.view(b, n, self.num_kv_heads, self.head_dim)
        keys, values = self.k_cache[:b, :p + n].transpose(1, 2), self.v_cache[:b, :p + n].transpose(1, 2)
        # NOTE: masks only where one is needed (no mask kernels per pass: a frame runs 15 x 5 of these).
        causal = None if n == 1 or p == 0 else torch.ones(n, p + n, dtype=torch.bool, device=q.device).tril(p)
        out = F.scaled_dot_product_attention(q.view(b, n, self.num_heads, self.head_dim).transpose(1, 2), keys,
                                             values, attn_mask=causal, is_causal=p == 0 and n > 1,
                                             scale=self.scale, enable_gqa=True)
        return out.transpose(1, 2).reshape(b * n, self.num_heads, self.head_dim)


class CodePredictorModel(DecoderModel):
    def __init__(self, cfg: DecoderConfig, num_code_groups: int) -> None:
        super().__init__(cfg)
        self.codec_embedding = nn.ModuleList(
            nn.Embedding(cfg.vocab_size, cfg.hidden_size) for _ in range(num_code_groups - 1))


def predictor_sampling(st: SamplingTensors) -> SamplingTensors:
    """The code predictor's sampling, derived on the device from the talker's: greedy rows stay greedy,
    the others sample at temperature 1 with top-k 50 / top-p 0.8 (as transformers does)."""
    ones = torch.ones_like(st.temperature)
    return replace(
        st, temperature=(st.temperature > 0).to(ones.dtype), top_k=torch.full_like(st.top_k, CP_TOP_K),
        top_p=ones * CP_TOP_P, min_p=ones * 0, repetition_penalty=ones, presence_penalty=ones * 0,
        frequency_penalty=ones * 0, need_truncation=not st.all_greedy)


class CodePredictor(nn.Module):
    def __init__(self, config) -> None:
        """`config`: transformers' `code_predictor_config` (object or dict)."""
        super().__init__()
        d = config if isinstance(config, dict) else config.to_dict()
        cfg = DecoderConfig.from_dict(d)
        self.num_code_groups = d["num_code_groups"]
        self.model = CodePredictorModel(cfg, self.num_code_groups)
        self.lm_head = nn.ModuleList(
            nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False) for _ in range(self.num_code_groups - 1))
        self._step = _Lockstep()
        for layer in self.model.layers:
            layer.self_attn.attn = StaticKVAttention(cfg.num_attention_heads, cfg.num_key_value_heads,
                                                     cfg.head_dim, cfg.head_dim**-0.5, self._step)

    def allocate_cache(self, max_rows: int) -> None:
        """Preallocate the per-row cache for up to `max_rows` rows (done on demand by `predict`)."""
        cfg = self.model.config
        w = self.lm_head[0].weight
        shape = (len(self.model.layers), 2, max_rows, self.num_code_groups, cfg.num_key_value_heads, cfg.head_dim)
        cache = torch.zeros(shape, dtype=w.dtype, device=w.device)
        for i, layer in enumerate(self.model.layers):
            layer.self_attn.attn.k_cache, layer.self_attn.attn.v_cache = cache[i, 0], cache[i, 1]
        cos, sin = self.model.rotary_emb(torch.arange(self.num_code_groups, device=w.device), w.dtype)
        self._rope = (cos, sin)
        self._prefill_rope = (cos[:2].repeat(max_rows, 1), sin[:2].repeat(max_rows, 1))  # rows [pos 0, pos 1]

    def _rope_rows(self, pos: int, n: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) `[rows * n, D/2]` of positions pos..pos+n-1 in every row, as views of the tables."""
        if n == 1:
            return self._rope[0][pos].expand(rows, -1), self._rope[1][pos].expand(rows, -1)
        if (pos, n) != (0, 2):
            raise ValueError(f"a pass of {n} positions from {pos}: only the 2-position prefill has tables")
        return self._prefill_rope[0][:rows * n], self._prefill_rope[1][:rows * n]

    def _pass(self, embeds: torch.Tensor, pos: int, rows: int) -> torch.Tensor:
        """One forward of `embeds [rows * n, H]` at positions pos..pos+n-1; the last hidden per row."""
        n = embeds.shape[0] // rows
        self._step.pos, self._step.rows = pos, rows
        hidden, _ = self.model(embeds, None, rope=self._rope_rows(pos, n, rows))
        return hidden.view(rows, n, -1)[:, -1]

    def predict(self, past_hidden: torch.Tensor, c0_embed: torch.Tensor, st: SamplingTensors,
                counters: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`past_hidden` [B, H]: the talker's final hidden at the row's last position; `c0_embed` [B, H]:
        the talker's codec embedding of codebook 0; `st`: see `predictor_sampling`; `counters` [B]: the
        draw counter of group 0 (group g draws at `counters + g`).
        Returns (codes [B, G-1], frame_embed [B, H] = c0_embed + sum_g codec_embedding[g-1](c_g))."""
        rows = past_hidden.shape[0]
        cache = self.model.layers[0].self_attn.attn.k_cache
        if cache.numel() == 0 or cache.shape[0] < rows:
            self.allocate_cache(rows)
        h = self._pass(torch.stack([past_hidden, c0_embed], 1).flatten(0, 1), 0, rows)
        codes, embeds = [], [c0_embed]
        for g in range(self.num_code_groups - 1):
            if g > 0:
                h = self._pass(embeds[-1], g + 1, rows)
            codes.append(sample(linear(h, self.lm_head[g].weight), st, counters + g + 1))
            embeds.append(self.model.codec_embedding[g](codes[-1]))
        # NOTE: one stacked sum, in transformers' order, so greedy parity holds bit for bit.
        return torch.stack(codes, 1), torch.stack(embeds, 1).sum(1)
