"""Prefills on static buffers: one CUDA graph per token bucket (thinker and talker), the same function run
eagerly on the same buffers elsewhere (CPU: what the tests exercise).

An eager prefill launches each layer's ~25 kernels from Python (a thinker decode step profiles at 1 219 for
48 layers), so under load a step that admits a request is mostly host time. Fresh prompts attend only to their
own rows. With `context_ratio`, a second graph per bucket takes prompts past a cached prefix (or a chunk
already prefilled), up to ratio x the largest bucket's rows cached in all, whatever its own bucket: their packed
context is prefix + new rows. (A room of ratio x its own T padded 32 one-row closes of realtime turns, 600
cached rows each, to the 4 096-row bucket: 40-56 ms steps on the H200 for what a 64-row run computes.)
How a run's rows, padding included, map to sequences and KV slots: prefill_layout.py.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import torch

from omnistage.engine.cuda_graph import CUDAGraphs
from omnistage.layers.context import ForwardContext, forward_context, to_device
from omnistage.models.qwen3_omni.decoder import Deepstack
from omnistage.pipeline.prefill_layout import run_layout

# (embeds [T, H], positions [3, T], capture, DeepStack rows or None) -> (hidden, capture layer's rows / None)
Forward = Callable[[torch.Tensor, torch.Tensor, bool, Deepstack | None],
                   tuple[torch.Tensor, torch.Tensor | None]]
Key = tuple[int, bool, bool, bool]  # (token bucket, with the capture layer, with DeepStack rows, past a prefix)


class PrefillGraphRunner:
    def __init__(self, forward: Forward, hidden_size: int, dtype: torch.dtype, device: torch.device,
                 token_buckets: Sequence[int], max_seqs: int, block_size: int, scratch_block: int,
                 deepstack_levels: int = 0, context_ratio: int = 0) -> None:
        """`forward`: the decoder over flat rows; prompts of up to max(token_buckets) rows in all and up to
        `max_seqs` prompts per run; padding rows write `scratch_block`. Each bucket has a graph without and
        one with the capture layer's rows as a second output (the thinker's multimodal prompts: the talker
        reads them), and with `deepstack_levels` one that also adds visual DeepStack rows: an index buffer and
        one row buffer per level, the rows past the step's added as zeros to row 0 (exact: x + 0 = x).
        `context_ratio`: each of those again for rows past cached ones (up to ratio x the largest bucket's)."""
        self.forward, self.buckets, self.max_seqs = forward, sorted(token_buckets), max_seqs
        self.block_size, self.scratch, self.context_ratio = block_size, scratch_block, context_ratio
        rows = self.buckets[-1]
        keys, seqs = rows * (1 + context_ratio), max_seqs + 2
        self.embeds = torch.zeros(rows, hidden_size, dtype=dtype, device=device)
        self.positions = torch.zeros(3, rows, dtype=torch.float32, device=device)
        self.slots = torch.zeros(rows, dtype=torch.long, device=device)
        self.kv_slots = torch.zeros(keys, dtype=torch.long, device=device)
        self.cu_q = torch.zeros(seqs + 1, dtype=torch.int32, device=device)
        self.cu_k = torch.zeros(seqs + 1, dtype=torch.int32, device=device)
        self.lens = torch.zeros(seqs, dtype=torch.int32, device=device)
        self.tables = torch.full((seqs, -(-keys // block_size)), scratch_block, dtype=torch.int32, device=device)
        self.ds_index = torch.zeros(rows if deepstack_levels else 0, dtype=torch.long, device=device)
        self.ds_rows = torch.zeros(deepstack_levels, rows if deepstack_levels else 0, hidden_size,
                                   dtype=dtype, device=device)
        self.graphs: CUDAGraphs | None = CUDAGraphs() if device.type == "cuda" else None

    @property
    def max_context(self) -> int:
        """The most cached rows one run reads."""
        return self.context_ratio * self.buckets[-1]

    def fits(self, lens: Sequence[int], computed: Sequence[int] = ()) -> bool:
        """Whether the prompts go in one run (`computed`: the rows each has in the cache already)."""
        return self.groups(lens, computed) == [(0, len(lens))] and self._bucket(sum(lens), sum(computed)) is not None

    def _bucket(self, total: int, cached: int) -> int | None:
        fits = (t for t in self.buckets if t >= total and cached <= self.max_context)
        return next(fits, None)

    def capture(self, with_capture_layer: bool = False) -> None:
        """Capture every bucket now (on CUDA), largest first (also the graphs with the capture layer, and
        with DeepStack rows where the runner has their buffers)."""
        kinds = [(False, False)] + [(True, False)] * with_capture_layer + [(True, True)] * (
            with_capture_layer and self.ds_rows.shape[0] > 0)
        for p in (False, True)[:1 + (self.context_ratio > 0)]:
            for key in [(t, c, d, p) for c, d in kinds for t in reversed(self.buckets)]:
                self._capture(key)

    def run(self, embeds: torch.Tensor, positions: torch.Tensor, lens: Sequence[int],
            tables: Sequence[Sequence[int]], capture: bool = False, deepstack: Deepstack | None = None,
            computed: Sequence[int] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(hidden states [sum(lens), H], the capture layer's when `capture`) of prompts' next `lens` rows
        (in order, through `tables`) past their `computed` rows (default none: fresh prompts), flat `embeds`
        and `positions` ([T] or [3, T]), `deepstack` their visual rows (with `capture`). Views of the graph's
        outputs: read them before the next run."""
        total, computed = sum(lens), list(computed) or [0] * len(lens)
        key = (self._bucket(total, sum(computed)), capture, deepstack is not None, any(computed))
        self._capture(key)
        self._load(key, embeds, positions, lens, tables, computed)
        if deepstack is not None:  # NOTE: only the bucket's rows are read: the rest stays as it is
            n, t = deepstack.index.numel(), key[0]
            self.ds_index[:n].copy_(deepstack.index)
            self.ds_index[n:t].zero_()
            self.ds_rows[:, n:t].zero_()
            for level, rows in enumerate(deepstack.embeds):
                self.ds_rows[level, :n].copy_(rows)
        hidden, captured = self._forward(key) if self.graphs is None else self.graphs.replay(key)
        return hidden[:total], None if captured is None else captured[:total]

    def groups(self, lens: Sequence[int], computed: Sequence[int] = ()) -> list[tuple[int, int]] | None:
        """Consecutive prompt ranges [a, b) that each fit one run (filled in order; `computed`: the rows each
        has cached); None when a prompt alone does not."""
        out, a, rows, cached = [], 0, 0, 0
        for i, (n, c) in enumerate(zip(lens, list(computed) or [0] * len(lens))):
            if n > self.buckets[-1] or c > self.max_context:
                return None
            if rows + n > self.buckets[-1] or cached + c > self.max_context or i - a == self.max_seqs:
                out.append((a, i))
                a, rows, cached = i, 0, 0
            rows, cached = rows + n, cached + c
        return out + [(a, len(lens))] if lens else out

    def run_last(self, embeds: torch.Tensor, positions: torch.Tensor, lens: Sequence[int],
                 tables: Sequence[Sequence[int]], computed: Sequence[int] = ()) -> torch.Tensor | None:
        """The hidden state of each prompt's last row, [len(lens), H], in as many runs as `groups` needs
        (`computed` as `run`'s); None when a prompt does not fit one."""
        computed = list(computed) or [0] * len(lens)
        groups = self.groups(lens, computed)
        if groups is None:
            return None
        starts = list(itertools.accumulate(lens, initial=0))
        out = []
        for a, b in groups:
            lo, hi = starts[a], starts[b]
            last = to_device([starts[i + 1] - 1 - lo for i in range(a, b)], torch.long, embeds.device)
            hidden = self.run(embeds[lo:hi], positions[..., lo:hi], lens[a:b], tables[a:b],
                              computed=computed[a:b])[0]
            out.append(hidden.index_select(0, last))
        return torch.cat(out)

    def fits_deepstack(self, deepstack: Deepstack | None) -> bool:
        return deepstack is None or len(deepstack.embeds) == self.ds_rows.shape[0] > 0
    def _capture(self, key: Key) -> None:
        if self.graphs is not None and key not in self.graphs:
            self._load(key, self.embeds[:0], self.positions[:, :0], [], [], [])  # warm-up, capture: padding
            self.graphs.capture(key, lambda: self._forward(key))

    def _load(self, key: Key, embeds: torch.Tensor, positions: torch.Tensor, lens: Sequence[int],
              tables: Sequence[Sequence[int]], computed: Sequence[int]) -> None:
        t, room, total = key[0], self._room(key), sum(lens)
        self.embeds[:total].copy_(embeds)
        self.positions[:, :total].copy_(positions.float().expand(3, -1) if positions.dim() == 1 else positions)
        run = run_layout(t, room, lens, computed, tables, self.max_seqs, self.tables.shape[1], self.scratch,
                         self.block_size)
        # NOTE: non_blocking from pageable memory is staged at once (see layers.context.to_device).
        self.slots[:t].copy_(run.slots, non_blocking=True)
        self.kv_slots[:t + room].copy_(run.kv_slots, non_blocking=True)
        for buf, host in ((self.cu_q, run.cu_q), (self.cu_k, run.cu_k), (self.lens, run.k_lens),
                          (self.tables, run.tables)):
            buf.copy_(host, non_blocking=True)

    def _room(self, key: Key) -> int:
        """Context rows a run of `key` reads past its bucket's (the cached ones)."""
        return self.max_context if key[3] else 0  # NOTE: the gather reads it all: ~1 ms a thinker step

    def _forward(self, key: Key) -> tuple[torch.Tensor, torch.Tensor | None]:
        t, capture, visual, _ = key
        keys = t + self._room(key)
        ds = Deepstack(self.ds_index[:t], list(self.ds_rows[:, :t])) if visual else None
        ctx = ForwardContext(is_prefill=True, cu_seqlens_q=self.cu_q, cu_seqlens_k=self.cu_k, max_seqlen_q=t,
                             max_seqlen_k=keys, context_lens=self.lens, slot_mapping=self.slots[:t],
                             block_tables=self.tables, block_size=self.block_size, kv_slots=self.kv_slots[:keys])
        with forward_context(ctx):
            return self.forward(self.embeds[:t], self.positions[:, :t], capture, ds)


def prefill_runner(model: torch.nn.Module, token_buckets: Sequence[int], max_seqs: int, block_size: int,
                   scratch_block: int, capture_layer: int | None = None, deepstack_levels: int = 0,
                   context_ratio: int = 0) -> PrefillGraphRunner | None:
    """A runner for `model` (a `DecoderModel`) on its device and dtype, `capture_layer` the layer its capture
    graphs output (see `DecoderModel.forward`), `deepstack_levels` its visual DeepStack levels; None without
    buckets."""
    if not token_buckets:
        return None
    w = model.norm.weight

    def forward(embeds: torch.Tensor, positions: torch.Tensor, capture: bool, deepstack: Deepstack | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        return model(embeds, positions, capture_layer if capture else None, deepstack)

    return PrefillGraphRunner(forward, w.numel(), w.dtype, w.device, token_buckets, max_seqs, block_size,
                              scratch_block, deepstack_levels, context_ratio)
