"""Code2Wav's streaming chunk step on static buffers: one CUDA graph per (batch bucket, chunk shape) on
CUDA, the same function run eagerly on the same buffers elsewhere (CPU: what the tests exercise).

Two chunk shapes: a stream's first chunk (`initial` frames, `first`: the transposed convs trim their
start) and every later chunk (`chunk` frames). A shorter chunk is always its stream's last (the stage
cuts one only once the frames have ended); it runs in its shape's graph, padded with stale codes, and
keeps only its own frames' samples: exact, as the decoder is causal (a sample never depends on a later
frame); the padding frames leave garbage in the stream's state, which is closed right after. So a step
is at most one replay per shape (per batch bucket), where exact final shapes would add an eager step
per distinct final length (~hundreds of kernel launches each); the price is at most `chunk - 1` frames
of extra compute once per stream, as padding rows cost within a bucket.

The per-stream state stays in `Code2WavStreamCache`'s fixed rows (one per slot, allocated once for
max_batch_size streams); the graph gathers and scatters it through a static slot-index buffer. Padding
rows point at the cache's scratch row, which no stream owns. No host sync; the host work per step is
O(frames in the step).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from omnistage.engine.cuda_graph import CUDAGraphs, batch_bucket
from omnistage.models.qwen3_omni.code2wav_stream import Code2WavStreamer, StreamState


class Code2WavGraphRunner:
    def __init__(self, streamer: Code2WavStreamer, batch_sizes: Sequence[int], initial_frames: int,
                 chunk_frames: int) -> None:
        """Buckets `batch_sizes`; first chunks of `initial_frames`, later ones of `chunk_frames`.
        Captures CUDA graphs when the model is on a CUDA device."""
        self.streamer, self.batch_sizes = streamer, sorted(batch_sizes)
        cfg, cache = streamer.model.config, streamer.cache
        dev = cache.pos.device
        self.samples_per_frame = math.prod(cfg.upsampling_ratios) * math.prod(cfg.upsample_rates)
        self.frames = {True: initial_frames, False: chunk_frames}  # by `first`
        rows = self.batch_sizes[-1]
        # NOTE: [rows, n, Q]: a row's frames are contiguous, so one index_copy_ loads a whole step.
        self.codes = {first: torch.zeros(rows, n, cfg.num_quantizers, dtype=torch.long, device=dev)
                      for first, n in self.frames.items()}
        self.slots = {first: torch.full((rows,), cache.scratch, dtype=torch.long, device=dev)
                      for first in self.frames}
        self.graphs: CUDAGraphs | None = CUDAGraphs() if dev.type == "cuda" else None

    def run(self, items: list[tuple[StreamState, torch.Tensor]], last: list[bool]) -> list[torch.Tensor]:
        """As `Code2WavStreamer.step`: new frames `codes [Q, n]` per stream (each at most once) -> its new
        samples. A chunk may be shorter than its shape only when it is its stream's `last`."""
        groups: dict[bool, list[int]] = {True: [], False: []}
        for i, (state, codes) in enumerate(items):
            first, n = state.frames == 0, codes.shape[-1]
            if n > self.frames[first] or (n < self.frames[first] and not last[i]):
                raise ValueError(f"a {'first' if first else 'later'} chunk of {n} frames does not fit "
                                 f"{self.frames[first]} (shorter only as a stream's last)")
            groups[first].append(i)
        out: list[torch.Tensor] = [None] * len(items)
        top = self.batch_sizes[-1]
        for first, idx in groups.items():
            for start in range(0, len(idx), top):
                part = idx[start:start + top]
                for i, wav in zip(part, self._run_group(first, [items[i] for i in part])):
                    out[i] = wav
        for state, codes in items:
            state.frames += codes.shape[-1]
        return out

    def _run_group(self, first: bool, group: list[tuple[StreamState, torch.Tensor]]) -> list[torch.Tensor]:
        k, n = len(group), self.frames[first]
        b = batch_bucket(k, self.batch_sizes)
        self._capture(b, first)
        self._load(first, group, b)
        wav = self._forward(b, first) if self.graphs is None else self.graphs.replay((b, n, first))
        # NOTE: a copy: a graph's output is overwritten by its next replay.
        wav = wav[:k, 0].clone()
        full, per_frame = wav.shape[-1], self.samples_per_frame
        return [wav[r, :full - (n - codes.shape[-1]) * per_frame] for r, (_, codes) in enumerate(group)]

    def capture(self) -> None:
        """Capture now (on CUDA) every (batch bucket, first / later chunk) graph, largest batch first: the
        shapes are fixed, so none is left for the first requests to pay."""
        for b in reversed(self.batch_sizes):
            for first in (True, False):
                self._capture(b, first)

    def _capture(self, b: int, first: bool) -> None:
        key = (b, self.frames[first], first)
        if self.graphs is not None and key not in self.graphs:
            self.slots[first][:b].fill_(self.streamer.cache.scratch)  # warm-up and capture: padding rows only
            self.graphs.capture(key, lambda: self._forward(b, first))

    def _load(self, first: bool, group: list[tuple[StreamState, torch.Tensor]], b: int) -> None:
        """Live rows' slots and frames into the static buffers; rows past them are padding (scratch slot)."""
        n, codes = self.frames[first], self.codes[first]
        slots = [s.slot for s, _ in group] + [self.streamer.cache.scratch] * (b - len(group))
        rows = [r * n + j for r, (_, c) in enumerate(group) for j in range(c.shape[-1])]
        dev = codes.device
        # NOTE: non_blocking from pageable memory is safe (staged before return) and skips a stream sync.
        self.slots[first][:b].copy_(torch.tensor(slots, dtype=torch.long), non_blocking=True)
        flat = torch.cat([c.t() for _, c in group])
        codes.view(-1, codes.shape[-1]).index_copy_(0, torch.tensor(rows).to(dev, non_blocking=True), flat)

    def _forward(self, b: int, first: bool) -> torch.Tensor:
        """The chunk step of the first `b` rows of the static buffers -> samples [b, 1, S]."""
        return self.streamer.decode_group(self.slots[first][:b], self.codes[first][:b].transpose(1, 2), first)
