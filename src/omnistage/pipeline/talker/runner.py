"""The talker's decode frame step on static buffers: one CUDA graph per (batch bucket, KV-width bucket)
on CUDA, the same function run eagerly on the same buffers elsewhere (CPU: what the tests exercise);
and the frame head alone (codebook 0 + code predictor, from a prefill's last hidden) as one graph per
batch bucket, so a prefill costs an eager talker forward, not ~10k eager kernels.

The graph is all of `Talker.step` for one row per request: talker forward over the paged KV cache,
codebook-0 sampling, the code predictor's passes with sampling, the next codec embedding. Padding rows
(past the live ones) have zero input at position 0, are greedy, use the `PenaltyTable`'s scratch row
and write KV only to the scratch block (`engine.cuda_graph.StaticDecodeContext`). Sampling always takes
its general path (the host flags `all_greedy` / `need_truncation` are fixed False / True): a greedy row is
still exactly its argmax (`sample` picks per row), and truncation with neutral parameters removes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from omnistage.engine.cuda_graph import CUDAGraphs, StaticDecodeContext, batch_bucket, width_bucket
from omnistage.engine.penalty_table import PenaltyTable
from omnistage.layers.context import forward_context
from omnistage.layers.sampling import FLOAT_FIELDS, INT_FIELDS, SamplingTensors, sampling_columns

_FLOATS = tuple(f for f, _ in FLOAT_FIELDS)
_INTS = INT_FIELDS  # rows 2, 3 of the int buffer; 0: positions, 1: frame index, 4: ignore_eos, 5: slots
_PADDING = object()  # sampling parameters of a padding row: every field at its neutral default (greedy)


@dataclass
class FrameBatch:
    """One talker step's requests in batch order: their input rows (flat [T, H]), rows per request,
    rows already cached, block tables, sampling parameters, seeds, frame numbers, and their rows of the
    stage's `PenaltyTable` (generated codebook-0 codes; updated by the step)."""

    inputs: torch.Tensor
    lens: list[int]
    num_computed: list[int]
    tables: list[list[int]]
    params: list[Any]
    seeds: list[int]
    frame_index: list[int]
    slots: list[int]
    mropes: list[Any] = field(default_factory=list)  # each request's MRope (3-D positions) or None


class TalkerGraphRunner:
    def __init__(self, talker: torch.nn.Module, batch_sizes: list[int], max_batch_size: int, max_width: int,
                 block_size: int, scratch_block: int, penalties: PenaltyTable) -> None:
        """Buckets `batch_sizes` (<= max_batch_size); block tables of up to `max_width` blocks; padding
        rows write `scratch_block`. Captures CUDA graphs when the talker is on a CUDA device."""
        p = talker.model.norm.weight
        dev = p.device
        self.talker, self.batch_sizes, self.penalties = talker, sorted(batch_sizes), penalties
        self.max_width, self.block_size = max_width, block_size
        self.min_width = 1  # the narrowest width captured at start (see `width_bucket`)
        rows = self.batch_sizes[-1]
        # NOTE: graphs hold the code predictor's cache by address: size it for the largest batch any step
        # (graph or eager) runs, so `CodePredictor.predict` never reallocates it.
        talker.code_predictor.allocate_cache(max(rows, max_batch_size))
        self.inputs = torch.zeros(rows, talker.codec_head.in_features, dtype=p.dtype, device=dev)
        self.hidden = torch.zeros_like(self.inputs)  # the head graphs' input: a prefill's last talker hidden
        self.ints = torch.zeros(2 + len(_INTS) + 2, rows, dtype=torch.long, device=dev)
        self.floats = torch.zeros(len(_FLOATS), rows, dtype=torch.float32, device=dev)
        self.rope_delta = torch.zeros(rows, dtype=torch.float32, device=dev)  # M-RoPE: position = index + delta
        self.last_index = torch.arange(rows, device=dev)
        self.context = StaticDecodeContext(rows, max_width, block_size, scratch_block, dev)
        self.graphs: CUDAGraphs | None = CUDAGraphs() if dev.type == "cuda" else None
        self._empty = FrameBatch(self.inputs[:0], [], [], [], [], [], [], [])

    def run(self, batch: FrameBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Decode step (one row per request) -> (frames [B, G], codec_embeds [B, H]) as `Talker.step`;
        None when B exceeds the largest bucket (the caller runs the step eagerly)."""
        n = len(batch.params)
        b = batch_bucket(n, self.batch_sizes)
        if b is None:
            return None
        w = width_bucket(-(-(max(batch.num_computed) + 1) // self.block_size), self.max_width, self.min_width)
        self._capture_step(b, w)
        self._load(b, w, batch, self.inputs, batch.inputs)
        return self._outputs(self._forward(b, w) if self.graphs is None else self.graphs.replay((b, w)), batch)

    def run_head(self, hidden: torch.Tensor, batch: FrameBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`Talker.head` on each request's last talker hidden [B, H] (after an eager prefill forward):
        codebook 0 and the code predictor as one graph per batch bucket; None past the largest bucket."""
        n = len(batch.params)
        b = batch_bucket(n, self.batch_sizes)
        if b is None:
            return None
        self._capture_head(b)
        self._load(b, None, batch, self.hidden, hidden)
        return self._outputs(self._head(b) if self.graphs is None else self.graphs.replay(("head", b)), batch)

    def capture(self, widths: Sequence[int]) -> None:
        """Capture now (on CUDA) every batch bucket's head graph and its step graphs for `widths` (KV blocks
        per row), largest batch first; other widths are captured when first needed."""
        self.min_width = min(widths, default=1)
        for b in reversed(self.batch_sizes):
            self._capture_head(b)
            for w in widths:
                self._capture_step(b, width_bucket(w, self.max_width))

    def _capture_step(self, b: int, w: int) -> None:
        if self.graphs is not None and (b, w) not in self.graphs:
            self._load(b, w, self._empty, self.inputs)  # warm-up and capture see padding rows only
            self.graphs.capture((b, w), lambda: self._forward(b, w))

    def _capture_head(self, b: int) -> None:
        if self.graphs is not None and ("head", b) not in self.graphs:
            self._load(b, None, self._empty, self.hidden)
            self.graphs.capture(("head", b), lambda: self._head(b))

    def _outputs(self, out: tuple[torch.Tensor, torch.Tensor], batch: FrameBatch) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(batch.params)
        # NOTE: copies: a graph's outputs are overwritten by its next replay, and frames go to code2wav.
        return out[0][:n].clone(), out[1][:n].clone()

    def _load(self, b: int, w: int | None, batch: FrameBatch, rows_buf: torch.Tensor,
              rows: torch.Tensor | None = None) -> None:
        """Copy the live rows (`rows` into `rows_buf`) into the static buffers, padding rows up to `b`;
        `w` None: no attention metadata (head only)."""
        n, pad = len(batch.params), [0] * (b - len(batch.params))
        if w is not None:
            self.context.fill(batch.num_computed, batch.tables, b, w)
        floats, sampling_ints = sampling_columns(batch.params + [_PADDING] * len(pad), batch.seeds + pad)

        def col(values: list) -> torch.Tensor:
            return torch.tensor(values + pad, dtype=torch.long)

        ignore_eos = [p.ignore_eos for p in batch.params]
        ints = [col(batch.num_computed), col(batch.frame_index), *sampling_ints,
                col(ignore_eos), torch.tensor(batch.slots + [self.penalties.scratch] * len(pad))]
        self.ints[:, :b].copy_(torch.stack(ints), non_blocking=True)
        self.floats[:, :b].copy_(floats, non_blocking=True)
        deltas = [0.0 if m is None else m.delta for m in batch.mropes]
        self.rope_delta[:b].copy_(torch.tensor(deltas + [0.0] * (b - len(deltas))), non_blocking=True)
        if rows is not None:
            rows_buf[:n].copy_(rows)
        rows_buf[n:b].zero_()

    def _sampling(self, b: int) -> SamplingTensors:
        return SamplingTensors(**{f: self.floats[i, :b] for i, f in enumerate(_FLOATS)},
                               **{f: self.ints[2 + i, :b] for i, f in enumerate(_INTS)},
                               all_greedy=False, need_truncation=True)

    def _forward(self, b: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`Talker.step` on the first `b` rows of the static buffers, gathering `w` KV blocks per row."""
        with forward_context(self.context.context(b, w)):
            return self.penalties.update_seen(self.ints[5, :b], lambda seen: self.talker.step(
                self.inputs[:b], self.ints[0, :b] + self.rope_delta[:b], self.last_index[:b], self._sampling(b),
                self.ints[1, :b], seen, self.ints[4, :b] != 0))

    def _head(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`Talker.head` on the first `b` rows of the static hidden buffer."""
        return self.penalties.update_seen(self.ints[5, :b], lambda seen: self.talker.head(
            self.hidden[:b], self._sampling(b), self.ints[1, :b], seen, self.ints[4, :b] != 0))
