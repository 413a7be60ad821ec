"""Code2Wav's streaming chunk step on static buffers: one CUDA graph per (batch bucket, chunk shape) on
CUDA, the same function run eagerly on the same buffers elsewhere (CPU: what the tests exercise).

Chunk shapes, keyed (n, first): a stream's first chunk (`initial` frames, one of the stage's `initials`;
`first`: the transposed convs trim their start) and every length the packet schedule
(`connector.packet_frames`) gives a later chunk (initial 2, cap 25, growth: 2, 4, 8, 16, 25; initial 1 adds
1). A chunk shorter than its schedule's length is always its stream's last (the stage cuts one only once the
frames have ended); it runs in the smallest shape of its kind that holds it, padded with stale codes, and
keeps only its own frames' samples: exact, as the decoder is causal (a sample never depends on a later frame,
and the samples that would need the first padding frame are the ones dropped); the padding frames leave
garbage in the stream's state, which is closed right after. So a step is at most one replay per shape (per
batch bucket), where exact final shapes would add an eager step per distinct final length (~hundreds of kernel
launches each); the price is once per stream a few padding frames of compute (fewer than the gap below the
shape: at most 8, 17 in 25, for the shapes above), as padding rows cost within a bucket.

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
from omnistage.layers.context import to_device
from omnistage.models.qwen3_omni.code2wav_stream import Code2WavStreamer, StreamState
from omnistage.pipeline.connector import PacketSchedule

Shape = tuple[int, bool]  # (frames, first)


class Code2WavGraphRunner:
    def __init__(self, streamer: Code2WavStreamer, batch_sizes: Sequence[int], initials: Sequence[int],
                 packets: PacketSchedule) -> None:
        """Buckets `batch_sizes`; first chunks of `initials` frames, later ones of `packets.later`. Captures CUDA
        graphs when the model is on a CUDA device."""
        self.streamer, self.batch_sizes = streamer, sorted(batch_sizes)
        cfg, cache = streamer.model.config, streamer.cache
        dev = cache.pos.device
        self.samples_per_frame = math.prod(cfg.upsampling_ratios) * math.prod(cfg.upsample_rates)
        # NOTE: ascending: `_shape` takes the first that holds a chunk.
        self.shapes = {True: sorted(set(initials)), False: list(packets.later)}
        keys = [(n, first) for first, ns in self.shapes.items() for n in ns]
        rows = self.batch_sizes[-1]
        # NOTE: [rows, n, Q]: a row's frames are contiguous, so one index_copy_ loads a whole step.
        self.codes = {k: torch.zeros(rows, k[0], cfg.num_quantizers, dtype=torch.long, device=dev)
                      for k in keys}
        self.slots = {k: torch.full((rows,), cache.scratch, dtype=torch.long, device=dev) for k in keys}
        self.graphs: CUDAGraphs | None = CUDAGraphs() if dev.type == "cuda" else None

    def run(self, items: list[tuple[StreamState, torch.Tensor]], last: list[bool],
            targets: list[int]) -> list[torch.Tensor]:
        """As `Code2WavStreamer.step`: new frames `codes [Q, n]` per stream (each at most once) -> its new
        samples. A chunk may be shorter than its schedule's length (`targets`) only when it is its stream's
        `last`."""
        groups: dict[Shape, list[int]] = {}
        for i, (state, codes) in enumerate(items):
            groups.setdefault(self._shape(state, codes.shape[-1], last[i], targets[i]), []).append(i)
        out: list[torch.Tensor] = [None] * len(items)
        top = self.batch_sizes[-1]
        for shape, idx in groups.items():
            for start in range(0, len(idx), top):
                part = idx[start:start + top]
                for i, wav in zip(part, self._run_group(shape, [items[i] for i in part])):
                    out[i] = wav
        for state, codes in items:
            state.frames += codes.shape[-1]
        return out

    def _shape(self, state: StreamState, n: int, last: bool, target: int) -> Shape:
        """The shape a chunk of `n` frames runs in: its schedule's length `target`, or (a shorter last chunk)
        the smallest of its kind that holds it."""
        first = state.frames == 0
        if target not in self.shapes[first]:
            raise ValueError(f"no {'first' if first else 'later'} chunk shape of {target} frames")
        if n > target or (n < target and not last):
            raise ValueError(f"a {'first' if first else 'later'} chunk of {n} frames does not fit {target} "
                             f"(shorter only as a stream's last)")
        return next(s for s in self.shapes[first] if s >= n), first

    def _run_group(self, shape: Shape, group: list[tuple[StreamState, torch.Tensor]]) -> list[torch.Tensor]:
        k, n = len(group), shape[0]
        b = batch_bucket(k, self.batch_sizes)
        self._capture(b, shape)
        self._load(shape, group, b)
        wav = self._forward(b, shape) if self.graphs is None else self.graphs.replay((b, *shape))
        # NOTE: a copy: a graph's output is overwritten by its next replay.
        wav = wav[:k, 0].clone()
        full, per_frame = wav.shape[-1], self.samples_per_frame
        return [wav[r, :full - (n - codes.shape[-1]) * per_frame] for r, (_, codes) in enumerate(group)]

    def capture(self) -> None:
        """Capture now (on CUDA) every (batch bucket, chunk shape) graph, largest batch and chunk first (the
        graphs share one memory pool): the shapes are fixed, so none is left for the first requests to pay."""
        for b in reversed(self.batch_sizes):
            for shape in sorted(self.codes, reverse=True):  # NOTE: longest first: the rest reuse its freed blocks
                self._capture(b, shape)

    def _capture(self, b: int, shape: Shape) -> None:
        if self.graphs is not None and (b, *shape) not in self.graphs:
            self.slots[shape][:b].fill_(self.streamer.cache.scratch)  # warm-up and capture: padding rows only
            self.graphs.capture((b, *shape), lambda: self._forward(b, shape))

    def _load(self, shape: Shape, group: list[tuple[StreamState, torch.Tensor]], b: int) -> None:
        """Live rows' slots and frames into the static buffers; rows past them are padding (scratch slot)."""
        n, codes = shape[0], self.codes[shape]
        slots = [s.slot for s, _ in group] + [self.streamer.cache.scratch] * (b - len(group))
        rows = [r * n + j for r, (_, c) in enumerate(group) for j in range(c.shape[-1])]
        # NOTE: non_blocking from pageable memory is safe (staged before return) and skips a stream sync.
        self.slots[shape][:b].copy_(torch.tensor(slots, dtype=torch.long), non_blocking=True)
        flat = torch.cat([c.t() for _, c in group])
        codes.view(-1, codes.shape[-1]).index_copy_(0, to_device(rows, torch.long, codes.device), flat)

    def _forward(self, b: int, shape: Shape) -> torch.Tensor:
        """The chunk step of the first `b` rows of `shape`'s static buffers -> samples [b, 1, S]."""
        codes = self.codes[shape][:b].transpose(1, 2)
        return self.streamer.decode_group(self.slots[shape][:b], codes, shape[1])
