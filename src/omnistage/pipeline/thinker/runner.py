"""The thinker's decode step on static buffers: one CUDA graph per (batch bucket, KV-width bucket) on
CUDA, the same function run eagerly on the same buffers elsewhere (CPU: what the tests exercise).

The graph is token ids -> embeddings -> thinker forward over the paged KV cache -> logits -> sampling
-> the sampled tokens' embeddings (which the stage sends to the talker). Penalties gather each row's
`seen` / `counts` from the stage's `PenaltyTable` by slot and record the sampled token there, in the
graph. A row whose last token is still in flight (asynchronous output) takes it from the launched step
on the device. Padding rows (past the live ones) feed token 0 at position 0, are greedy, use the
table's scratch row and write KV only to the scratch block (`engine.cuda_graph.StaticDecodeContext`).
Sampling always takes its general path, as in `pipeline.talker.runner`: a greedy row is still its argmax,
neutral truncation removes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from omnistage.engine.cuda_graph import CUDAGraphs, StaticDecodeContext, batch_bucket, width_bucket
from omnistage.engine.penalty_table import PenaltyTable
from omnistage.layers.context import forward_context, to_device
from omnistage.layers.sampling import FLOAT_FIELDS, INT_FIELDS, SamplingTensors, sample, sampling_columns
from omnistage.pipeline.thinker.seq import Launched, ThinkerSeq

_FLOATS = tuple(f for f, _ in FLOAT_FIELDS)
_INTS = INT_FIELDS  # rows 3, 4 of the int buffer; 0: token ids, 1: positions, 2: steps, 5: slots
_PADDING = object()  # sampling parameters of a padding row: every field at its neutral default (greedy)


class ThinkerGraphRunner:
    def __init__(self, thinker: torch.nn.Module, batch_sizes: list[int], max_width: int, block_size: int,
                 scratch_block: int, penalties: PenaltyTable) -> None:
        """Buckets `batch_sizes`; block tables of up to `max_width` blocks; padding rows write
        `scratch_block`. Captures CUDA graphs when the thinker is on a CUDA device."""
        dev = next(thinker.parameters()).device
        self.thinker, self.batch_sizes, self.penalties = thinker, sorted(batch_sizes), penalties
        self.max_width, self.block_size = max_width, block_size
        self.min_width = 1  # the narrowest width captured at start (see `width_bucket`)
        self.max_captured = 0  # the widest (0: none captured at start; any width is captured when needed)
        rows = self.batch_sizes[-1]
        self.ints = torch.zeros(4 + len(_INTS), rows, dtype=torch.long, device=dev)
        self.floats = torch.zeros(len(_FLOATS), rows, dtype=torch.float32, device=dev)
        self.rope_delta = torch.zeros(rows, dtype=torch.float32, device=dev)  # M-RoPE: position = index + delta
        self.context = StaticDecodeContext(rows, max_width, block_size, scratch_block, dev)
        self.graphs: CUDAGraphs | None = CUDAGraphs() if dev.type == "cuda" else None

    def run(self, seqs: list[ThinkerSeq], tables: list[list[int]], pending: Launched | None = None
            ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Decode step of `seqs` (each feeds its last token: from `pending`, the step in flight, when it is
        there) -> (tokens [B], their embeddings [B, H]); None when B exceeds the largest bucket (the caller
        runs the step eagerly)."""
        n = len(seqs)
        b = batch_bucket(n, self.batch_sizes)
        if b is None:
            return None
        need = -(-(max(s.num_computed for s in seqs) + 1) // self.block_size)
        w = width_bucket(need, self.max_width, self.min_width)
        if self.graphs is not None and self.max_captured and w > self.max_captured:
            return None  # NOTE: never a capture in the middle of serving: past the start's widths, eagerly
        self._capture(b, w)
        self._load(b, w, seqs, tables, pending)
        tokens, embeds = self._forward(b, w) if self.graphs is None else self.graphs.replay((b, w))
        # NOTE: copies: a graph's outputs are overwritten by its next replay, and embeds go to the talker.
        return tokens[:n].clone(), embeds[:n].clone()

    def capture(self, widths: Sequence[int]) -> None:
        """Capture now (on CUDA) every batch bucket's graphs for `widths` (KV blocks per row), largest batch
        first; wider ones then run eagerly, narrower ones are captured when first needed."""
        self.min_width = min(widths, default=1)
        self.max_captured = max((width_bucket(w, self.max_width) for w in widths), default=0)
        for b in reversed(self.batch_sizes):
            for w in widths:
                self._capture(b, width_bucket(w, self.max_width))

    def _capture(self, b: int, w: int) -> None:
        if self.graphs is not None and (b, w) not in self.graphs:
            self._load(b, w, [], [])  # warm-up and capture see padding rows only
            self.graphs.capture((b, w), lambda: self._forward(b, w))

    def _load(self, b: int, w: int, seqs: list[ThinkerSeq], tables: list[list[int]],
              pending: Launched | None = None) -> None:
        """Copy the live rows into the static buffers, padding rows up to `b`."""
        pad = [0] * (b - len(seqs))
        computed = [s.num_computed for s in seqs]
        self.context.fill(computed, tables, b, w)
        floats, sampling_ints = sampling_columns([s.req.sampling for s in seqs] + [_PADDING] * len(pad),
                                                 [s.req.seed for s in seqs] + pad)

        def col(values: list[int]) -> torch.Tensor:
            return torch.tensor(values + pad, dtype=torch.long)

        in_flight = {id(s): i for i, s in enumerate(pending.seqs)} if pending is not None else {}
        last = [0 if id(s) in in_flight else s.output_ids[-1] for s in seqs]
        ints = [col(last), col(computed), col([s.num_sampled for s in seqs]), *sampling_ints,
                torch.tensor([s.slot for s in seqs] + [self.penalties.scratch] * len(pad))]
        self.ints[:, :b].copy_(torch.stack(ints), non_blocking=True)
        self.floats[:, :b].copy_(floats, non_blocking=True)
        self.rope_delta[:b].copy_(torch.tensor([s.rope_delta for s in seqs] + [0.0] * len(pad)), non_blocking=True)
        rows = [i for i, s in enumerate(seqs) if id(s) in in_flight]
        if rows:
            src = to_device([in_flight[id(seqs[i])] for i in rows], torch.long, self.ints.device)
            self.ints[0].index_copy_(0, to_device(rows, torch.long, self.ints.device), pending.tokens[src])

    def _forward(self, b: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode step on the first `b` rows of the static buffers, gathering `w` KV blocks per row."""
        st = SamplingTensors(**{f: self.floats[i, :b] for i, f in enumerate(_FLOATS)},
                             **{f: self.ints[3 + i, :b] for i, f in enumerate(_INTS)},
                             all_greedy=False, need_truncation=True)
        model = self.thinker.model
        with forward_context(self.context.context(b, w)):
            hidden, _ = model(model.embed_tokens(self.ints[0, :b]), self.ints[1, :b] + self.rope_delta[:b])
        return sample_tokens(self.thinker, self.penalties, self.thinker.compute_logits(hidden), st,
                             self.ints[2, :b], self.ints[5, :b])


def sample_tokens(thinker: torch.nn.Module, penalties: PenaltyTable, logits: torch.Tensor, st: SamplingTensors,
                  steps: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B], their embeddings [B, H]) sampled from `logits` [B, V] with each row's penalty state
    (gathered by `slots`; the tokens are recorded there); `steps`: the rows' draw counters."""
    seen, counts = penalties.gather(slots)
    tokens = sample(logits, st, steps, seen=seen, counts=counts)
    penalties.record(slots, tokens)
    return tokens, thinker.model.embed_tokens(tokens)
