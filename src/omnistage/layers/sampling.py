"""Batched on-device token sampling with per-row parameters.

Fixed shapes, no host syncs, so a step that samples can be captured in a CUDA graph. Order follows
transformers' `generate()`: repetition penalty -> presence/frequency penalties -> suppressed ids
(greedy rows take the argmax here) -> temperature -> top-k -> top-p -> min-p -> draw.
A draw is the exponential race `argmax(logits - log E)`, E ~ Exp(1), with E made by a counter-based
hash of (seed, step, token id): a seeded row draws the same tokens whatever else is in the batch, on
CPU and GPU alike, and the noise needs no generator state.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from omnistage.layers import triton_ops, triton_sampling

_M32 = 0xFFFFFFFF
# (field, neutral value) of the float parameters, and the int ones, in `sampling_columns`' row order
FLOAT_FIELDS = (("temperature", 0.0), ("top_p", 1.0), ("min_p", 0.0), ("repetition_penalty", 1.0),
                ("presence_penalty", 0.0), ("frequency_penalty", 0.0))
INT_FIELDS = ("seeds", "top_k")


@dataclass
class SamplingTensors:
    """Per-row sampling parameters on the device ([B] each). `temperature == 0` is greedy; `top_k <= 0`
    is off. The two flags are host-side facts about the batch that let a step skip work."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    repetition_penalty: torch.Tensor
    presence_penalty: torch.Tensor
    frequency_penalty: torch.Tensor
    seeds: torch.Tensor
    all_greedy: bool = False
    need_truncation: bool = True

    @classmethod
    def build(cls, params: Sequence[Any], seeds: Sequence[int], device: torch.device | str = "cpu"
              ) -> SamplingTensors:
        """From per-row parameter objects (missing fields take neutral values) and per-row seeds.
        NOTE: built on the host, then two non_blocking copies: a blocking copy would wait for the step in
        flight on the device's stream."""
        floats, ints = (t.to(device, non_blocking=True) for t in sampling_columns(params, seeds))
        sampled = [p for p in params if getattr(p, "temperature", 0.0) > 0]
        return cls(
            **{f: floats[i] for i, (f, _) in enumerate(FLOAT_FIELDS)},
            **{f: ints[i] for i, f in enumerate(INT_FIELDS)},
            all_greedy=not sampled,
            need_truncation=any(getattr(p, "top_k", 0) > 0 or getattr(p, "top_p", 1.0) < 1
                                or getattr(p, "min_p", 0.0) > 0 for p in sampled),
        )


def sampling_columns(params: Sequence[Any], seeds: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row parameters as host tensors: floats [len(FLOAT_FIELDS), B] and ints [2, B] (INT_FIELDS), missing
    fields at their neutral values (what the graph runners copy into their static buffers)."""
    floats = torch.tensor([[getattr(p, f, d) for p in params] for f, d in FLOAT_FIELDS], dtype=torch.float32)
    return floats, torch.tensor([list(seeds), [getattr(p, "top_k", 0) for p in params]], dtype=torch.int64)


def request_seed(seed: int | None) -> int:
    """The seed a request samples with: its own, else a fresh random one (kept for the request's life)."""
    return seed if seed is not None else random.getrandbits(62)


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    # NOTE: int64 tensors holding values in [0, 2**32); products may wrap past 2**63, the low 32 bits stay exact.
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _M32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _M32
    return x ^ (x >> 16)


def exponential_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) noise [B, vocab], a pure function of (seed, step, token id) per element."""
    key = _fmix32(_fmix32(seeds & _M32) ^ ((seeds >> 32) & _M32))
    key = _fmix32((key + steps) & _M32)[:, None]
    # NOTE: token ids enter only through `key + id`, never multiplied: inductor keeps an arange as an int32
    # index expression and then fails on (or overflows) products with 32-bit constants.
    h = _fmix32((key + torch.arange(vocab, device=seeds.device, dtype=torch.int64)) & _M32)
    h = _fmix32(h ^ _fmix32(key ^ 0x5BD1E995))
    u = ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
    return -torch.log(u)


def apply_penalties(logits: torch.Tensor, st: SamplingTensors, seen: torch.Tensor | None = None,
                    counts: torch.Tensor | None = None) -> torch.Tensor:
    """Repetition penalty on ids in `seen` [B, V] (negative logits * p, others / p, as transformers),
    then `- frequency * count - presence * (count > 0)` from `counts` [B, V]."""
    if seen is not None:
        pen = st.repetition_penalty[:, None]
        logits = torch.where(seen, torch.where(logits < 0, logits * pen, logits / pen), logits)
    if counts is not None:
        counts = counts.to(logits.dtype)
        logits = logits - st.frequency_penalty[:, None] * counts - st.presence_penalty[:, None] * (counts > 0)
    return logits


def truncate(x: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """top-k, then top-p, then min-p on temperature-scaled logits; removed ids become -inf."""
    vocab = x.shape[-1]
    sorted_x, order = x.sort(dim=-1, stable=True)  # NOTE: ties cut by top-p in index order, on every device
    k = torch.where(st.top_k > 0, st.top_k, vocab).clamp(max=vocab)
    remove = sorted_x < sorted_x.gather(1, (vocab - k)[:, None])
    probs = sorted_x.masked_fill(remove, float("-inf")).softmax(-1)
    cut = probs.cumsum(-1) <= (1 - st.top_p)[:, None]
    cut[:, -1] = False
    remove = remove | cut
    probs = sorted_x.masked_fill(remove, float("-inf")).softmax(-1)
    remove = remove | (probs < st.min_p[:, None] * probs[:, -1:])
    return x.masked_fill(remove.scatter(1, order, remove), float("-inf"))


def process_logits(logits: torch.Tensor, st: SamplingTensors, seen: torch.Tensor | None = None,
                   counts: torch.Tensor | None = None, suppress: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(greedy-view logits, sampling-view logits): penalties + suppress, then for the second view
    temperature and truncation as well. `suppress` is a bool mask [V] or [B, V]."""
    logits = apply_penalties(logits.float(), st, seen, counts)
    if suppress is not None:
        logits = logits.masked_fill(suppress, float("-inf"))
    if st.all_greedy:
        return logits, logits
    temp = torch.where(st.temperature > 0, st.temperature, torch.ones_like(st.temperature))
    scaled = logits / temp[:, None]
    return logits, (truncate(scaled, st) if st.need_truncation else scaled)


def sample(logits: torch.Tensor, st: SamplingTensors, steps: torch.Tensor, seen: torch.Tensor | None = None,
           counts: torch.Tensor | None = None, suppress: torch.Tensor | None = None) -> torch.Tensor:
    """Token ids [B] from logits [B, V]. `steps` [B] int64 is each row's draw counter: the same
    (seed, step) gives the same draw, so callers advance it once per token they sample."""
    if triton_sampling.supports(logits):
        return triton_sampling.fused_sample(logits, st, steps, seen, counts, suppress)
    greedy_view, sample_view = process_logits(logits, st, seen, counts, suppress)
    greedy = greedy_view.argmax(-1)
    if st.all_greedy:
        return greedy
    drawn = race(sample_view, st.seeds, steps)
    return torch.where(st.temperature > 0, drawn, greedy)


def race(scores: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """The exponential race: `argmax(scores - log E)` per row; one fused kernel on CUDA."""
    if triton_ops.fast_path(scores) and scores.dtype == torch.float32:
        return triton_ops.race_argmax(scores, seeds, steps)
    return (scores - exponential_noise(seeds, steps, scores.shape[-1]).log()).argmax(-1)


def record_tokens(tokens: torch.Tensor, seen: torch.Tensor | None = None,
                  counts: torch.Tensor | None = None) -> None:
    """Add sampled `tokens` [B] to the per-row `seen` mask and `counts` in place."""
    if seen is not None:
        seen.scatter_(1, tokens[:, None], True)
    if counts is not None:
        counts.scatter_add_(1, tokens[:, None], torch.ones_like(tokens[:, None], dtype=counts.dtype))
