"""Prefills of fresh prompts on static buffers: one CUDA graph per token bucket (thinker and talker), the
same function run eagerly on the same buffers elsewhere (CPU: what the tests exercise).

An eager prefill launches each layer's ~25 kernels from Python (a thinker decode step profiles at 1 219 for
48 layers), so under load a step that admits a request is mostly host time. Prompts with nothing cached yet attend only to their own rows, so
the packed context is the new rows themselves: one slot buffer serves as `slot_mapping` and `kv_slots`,
one offset buffer as `cu_seqlens_q` and `cu_seqlens_k`. The rows past the live ones (up to the bucket)
form one padding sequence that writes and reads the scratch block (slot i % block_size), and the
sequences past it are empty (their offsets repeat), so every row stays finite and no live row sees them.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import torch

from omnistage.engine.cuda_graph import CUDAGraphs, batch_bucket
from omnistage.layers.context import ForwardContext, forward_context, to_device
from omnistage.models.qwen3_omni.decoder import Deepstack

# (embeds [T, H], positions [3, T], capture, DeepStack rows or None) -> (hidden, capture layer's rows / None)
Forward = Callable[[torch.Tensor, torch.Tensor, bool, Deepstack | None],
                   tuple[torch.Tensor, torch.Tensor | None]]
Key = tuple[int, bool, bool]  # (token bucket, with the capture layer, with DeepStack rows)


class PrefillGraphRunner:
    def __init__(self, forward: Forward, hidden_size: int, dtype: torch.dtype, device: torch.device,
                 token_buckets: Sequence[int], max_seqs: int, block_size: int, scratch_block: int,
                 deepstack_levels: int = 0) -> None:
        """`forward`: the decoder over flat rows; prompts of up to max(token_buckets) rows in all and up to
        `max_seqs` prompts per run; padding rows write `scratch_block`. Each bucket has a graph without and
        one with the capture layer's rows as a second output (the thinker's multimodal prompts: the talker
        reads them), and with `deepstack_levels` one that also adds visual DeepStack rows: an index buffer and
        one row buffer per level, the rows past the step's added as zeros to row 0 (exact: x + 0 = x)."""
        self.forward, self.buckets, self.max_seqs = forward, sorted(token_buckets), max_seqs
        self.block_size, self.scratch = block_size, scratch_block
        rows, width = self.buckets[-1], -(-self.buckets[-1] // block_size)
        self.embeds = torch.zeros(rows, hidden_size, dtype=dtype, device=device)
        self.positions = torch.zeros(3, rows, dtype=torch.float32, device=device)
        self.slots = torch.zeros(rows, dtype=torch.long, device=device)
        self.cu = torch.zeros(max_seqs + 2, dtype=torch.int32, device=device)
        self.lens = torch.zeros(max_seqs + 1, dtype=torch.int32, device=device)
        self.tables = torch.full((max_seqs + 1, width), scratch_block, dtype=torch.int32, device=device)
        self.ds_index = torch.zeros(rows if deepstack_levels else 0, dtype=torch.long, device=device)
        self.ds_rows = torch.zeros(deepstack_levels, rows if deepstack_levels else 0, hidden_size,
                                   dtype=dtype, device=device)
        self.graphs: CUDAGraphs | None = CUDAGraphs() if device.type == "cuda" else None

    def fits(self, lens: Sequence[int]) -> bool:
        """Whether the prompts go in one run."""
        return self.groups(lens) == [(0, len(lens))]

    def capture(self, with_capture_layer: bool = False) -> None:
        """Capture every bucket now (on CUDA), largest first (also the graphs with the capture layer, and
        with DeepStack rows where the runner has their buffers)."""
        kinds = [(False, False)] + [(True, False)] * with_capture_layer + [(True, True)] * (
            with_capture_layer and self.ds_rows.shape[0] > 0)
        for key in [(t, c, d) for c, d in kinds for t in reversed(self.buckets)]:
            self._capture(key)

    def run(self, embeds: torch.Tensor, positions: torch.Tensor, lens: Sequence[int],
            tables: Sequence[Sequence[int]], capture: bool = False, deepstack: Deepstack | None = None
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(hidden states [sum(lens), H], the capture layer's when `capture`) of fresh prompts (`lens` rows
        each, in order, through `tables`), flat `embeds` and `positions` ([T] or [3, T]), `deepstack` their
        visual rows (with `capture`). Views of the graph's outputs: read them before the next run."""
        total = sum(lens)
        key = (batch_bucket(total, self.buckets), capture, deepstack is not None)
        self._capture(key)
        self._load(key[0], embeds, positions, lens, tables)
        if deepstack is not None:  # NOTE: only the bucket's rows are read: the rest stays as it is
            n, t = deepstack.index.numel(), key[0]
            self.ds_index[:n].copy_(deepstack.index)
            self.ds_index[n:t].zero_()
            self.ds_rows[:, n:t].zero_()
            for level, rows in enumerate(deepstack.embeds):
                self.ds_rows[level, :n].copy_(rows)
        hidden, captured = self._forward(key) if self.graphs is None else self.graphs.replay(key)
        return hidden[:total], None if captured is None else captured[:total]

    def groups(self, lens: Sequence[int]) -> list[tuple[int, int]] | None:
        """Consecutive prompt ranges [a, b) that each fit one run (filled in order); None when a prompt alone
        does not."""
        out, a, rows = [], 0, 0
        for i, n in enumerate(lens):
            if n > self.buckets[-1]:
                return None
            if rows + n > self.buckets[-1] or i - a == self.max_seqs:
                out.append((a, i))
                a, rows = i, 0
            rows += n
        return out + [(a, len(lens))] if lens else out

    def run_last(self, embeds: torch.Tensor, positions: torch.Tensor, lens: Sequence[int],
                 tables: Sequence[Sequence[int]]) -> torch.Tensor | None:
        """The hidden state of each fresh prompt's last row, [len(lens), H], in as many runs as `groups`
        needs; None when a prompt exceeds the largest bucket."""
        groups = self.groups(lens)
        if groups is None:
            return None
        starts = list(itertools.accumulate(lens, initial=0))
        out = []
        for a, b in groups:
            lo, hi = starts[a], starts[b]
            last = to_device([starts[i + 1] - 1 - lo for i in range(a, b)], torch.long, embeds.device)
            hidden = self.run(embeds[lo:hi], positions[..., lo:hi], lens[a:b], tables[a:b])[0]
            out.append(hidden.index_select(0, last))
        return torch.cat(out)

    def fits_deepstack(self, deepstack: Deepstack | None) -> bool:
        return deepstack is None or len(deepstack.embeds) == self.ds_rows.shape[0] > 0
    def _capture(self, key: Key) -> None:
        if self.graphs is not None and key not in self.graphs:
            self._load(key[0], self.embeds[:0], self.positions[:, :0], [], [])  # warm-up, capture: padding
            self.graphs.capture(key, lambda: self._forward(key))

    def _load(self, t: int, embeds: torch.Tensor, positions: torch.Tensor, lens: Sequence[int],
              tables: Sequence[Sequence[int]]) -> None:
        n, total, bs = len(lens), sum(lens), self.block_size
        self.embeds[:total].copy_(embeds)
        self.positions[:, :total].copy_(positions.float().expand(3, -1) if positions.dim() == 1 else positions)
        seq_lens = torch.tensor([*lens, t - total] + [0] * (self.max_seqs - n), dtype=torch.int32)
        cu = torch.cat([torch.zeros(1, dtype=torch.int32), seq_lens.cumsum(0, dtype=torch.int32)])
        rows = torch.full(self.tables.shape, self.scratch, dtype=torch.int32)  # the padding sequence: scratch
        for i, (m, tb) in enumerate(zip(lens, tables)):
            rows[i, :-(-m // bs)] = torch.tensor(tb[:-(-m // bs)], dtype=torch.int32)
        seq = torch.repeat_interleave(torch.arange(n + 1), seq_lens[:n + 1])
        pos = torch.arange(t) - cu[seq]
        # NOTE: non_blocking from pageable memory is staged at once (see layers.context.to_device).
        self.slots[:t].copy_(rows[seq, pos // bs].long() * bs + pos % bs, non_blocking=True)
        self.cu.copy_(cu, non_blocking=True)
        self.lens.copy_(seq_lens, non_blocking=True)
        self.tables.copy_(rows, non_blocking=True)

    def _forward(self, key: Key) -> tuple[torch.Tensor, torch.Tensor | None]:
        t, capture, visual = key
        ds = Deepstack(self.ds_index[:t], list(self.ds_rows[:, :t])) if visual else None
        ctx = ForwardContext(is_prefill=True, cu_seqlens_q=self.cu, cu_seqlens_k=self.cu, max_seqlen_q=t,
                             max_seqlen_k=t, context_lens=self.lens, slot_mapping=self.slots[:t],
                             block_tables=self.tables, block_size=self.block_size, kv_slots=self.slots[:t])
        with forward_context(ctx):
            return self.forward(self.embeds[:t], self.positions[:, :t], capture, ds)


def prefill_runner(model: torch.nn.Module, token_buckets: Sequence[int], max_seqs: int, block_size: int,
                   scratch_block: int, capture_layer: int | None = None, deepstack_levels: int = 0
                   ) -> PrefillGraphRunner | None:
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
                              scratch_block, deepstack_levels)
