"""Stateful streaming Code2Wav: each frame is decoded once; the chunks concatenate to the one-shot decode.

Code2Wav is causal except that each trimmed transposed conv's output needs one input past it, so
the one-shot decode of N frames is a prefix of the decode of N+1 frames. A stream emits, per chunk,
exactly the samples that are final: the first chunk of n frames gives n*1920 - 555 samples, every
later chunk n*1920. After N frames the stream has emitted N*1920 - 555 samples, the one-shot total;
there is nothing to flush (the last 555 samples would need frame N+1, and the one-shot decode does
not produce them either).

Per request the cache holds, in preallocated slots (`max_streams` rows), every causal conv's left
context, the last input of each trimmed transposed conv, each attention layer's RoPE'd keys/values
of the last `sliding_window - 1` frames, and the frame count. Nothing grows with utterance length.
One more row, `scratch`, belongs to no stream: padding rows of fixed-shape batches read and write it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from omnistage.layers.context import to_device
from omnistage.models.qwen3_omni.code2wav import Code2Wav


@dataclass
class StreamState:
    """A request's handle: its cache slot and how many frames it has decoded."""
    slot: int
    frames: int = 0


class Code2WavStreamCache:
    """Per-layer state buffers [max_streams + 1, *layer.state_shape] and frame positions [max_streams + 1];
    row `scratch` (the last) is never allocated to a stream."""

    def __init__(self, model: nn.Module, max_streams: int):
        p = next(model.parameters())
        self.states = {m: torch.zeros(max_streams + 1, *m.state_shape, dtype=p.dtype, device=p.device)
                       for m in model.modules() if getattr(m, "state_shape", None)}
        self.pos = torch.zeros(max_streams + 1, dtype=torch.long, device=p.device)
        self.scratch = max_streams
        self.free_slots = list(range(max_streams - 1, -1, -1))

    def allocate(self) -> int:
        if not self.free_slots:
            raise RuntimeError("code2wav stream cache is full")
        slot = self.free_slots.pop()
        # NOTE: one launch for every layer's state row (one launch each was ~1.4 ms of host a stream under load)
        torch._foreach_zero_([buf[slot] for buf in self.states.values()] + [self.pos[slot]])
        return slot

    def free(self, slot: int) -> None:
        self.free_slots.append(slot)


class StreamContext:
    """One batched chunk step: rows `slots` of the cache; `first` when they have decoded no frame yet."""

    def __init__(self, cache: Code2WavStreamCache, slots: torch.Tensor, first: bool):
        self.cache, self.slots, self.first = cache, slots, first
        self.pos = cache.pos.index_select(0, slots)

    def extend(self, layer: nn.Module, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """`x` with the layer's saved context prepended along `dim`; the tail of the result is saved."""
        x = torch.cat((self.past(layer), x), dim=dim)
        self.save(layer, x, dim)
        return x

    def past(self, layer: nn.Module) -> torch.Tensor:
        """The layer's saved context of these rows."""
        return self.cache.states[layer].index_select(0, self.slots)

    def save(self, layer: nn.Module, x: torch.Tensor, dim: int = -1) -> None:
        """Save the tail of `x` along `dim` (as long as the layer's context) as these rows' context."""
        buf = self.cache.states[layer]
        keep = buf.shape[dim]
        buf.index_copy_(0, self.slots, x.narrow(dim, x.shape[dim] - keep, keep))

    def advance(self, frames: int) -> None:
        self.cache.pos.index_copy_(0, self.slots, self.pos + frames)


class Code2WavStreamer:
    """Batched streaming decode over many requests.

    `step` groups requests by (chunk length, first chunk); each group is one fixed-shape batched
    forward (`decode_group`), the unit `pipeline.code2wav.runner` captures per (batch bucket, n, first).
    """

    def __init__(self, model: Code2Wav, max_streams: int):
        self.model = model
        self.cache = Code2WavStreamCache(model, max_streams)

    def open(self) -> StreamState:
        return StreamState(self.cache.allocate())

    def close(self, state: StreamState) -> None:
        self.cache.free(state.slot)

    @torch.no_grad()
    def step(self, items: list[tuple[StreamState, torch.Tensor]]) -> list[torch.Tensor]:
        """Decode new frames `codes [Q, n]` per request (each state at most once); new samples per request."""
        groups: dict[tuple[int, bool], list[int]] = {}
        for i, (state, codes) in enumerate(items):
            groups.setdefault((codes.shape[-1], state.frames == 0), []).append(i)
        out: list[torch.Tensor] = [None] * len(items)
        for (n, first), idx in groups.items():
            slots = to_device([items[i][0].slot for i in idx], torch.long, self.cache.pos.device)
            wav = self.decode_group(slots, torch.stack([items[i][1] for i in idx]), first)
            for row, i in enumerate(idx):
                out[i] = wav[row, 0]
                items[i][0].frames += n
        return out

    def decode_group(self, slots: torch.Tensor, codes: torch.Tensor, first: bool) -> torch.Tensor:
        """Chunk `codes [B, Q, n]` of the streams in cache rows `slots [B]` -> new samples [B, 1, S]."""
        ctx = StreamContext(self.cache, slots, first)
        wav = self.model(codes, ctx)
        ctx.advance(codes.shape[-1])
        return wav
