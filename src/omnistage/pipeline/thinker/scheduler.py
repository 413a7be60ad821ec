"""The thinker's scheduler: which rows each step computes, over the admitted requests' `ThinkerSeq`s.

Every running decode first (one row each, up to `max_batch_size`), then prefill chunks within the token
budget: the running prompts' next chunks, then waiting prompts in arrival order (their cached prefix taken
first, none while a request is swapped out). KV blocks are taken as rows are scheduled (engine/kv_growth.py: room
made first, the newest swapped out while it runs out; a row refused a block waits a step), a penalty row once the
prompt is whole; `release` gives them back.
"""

from __future__ import annotations

from collections import deque

from omnistage.engine.kv_growth import KvGrowth
from omnistage.engine.penalty_table import PenaltyTable
from omnistage.pipeline.thinker.prefix import take_prefix
from omnistage.pipeline.thinker.seq import ThinkerSeq


class ThinkerScheduler:
    def __init__(self, kv: KvGrowth, penalties: PenaltyTable, max_batch_size: int, token_budget: int,
                 graph_tokens: int, max_context: int = 0) -> None:
        """`graph_tokens`: the largest prompt the prefill graphs take whole; `max_context`: the most cached rows
        one prefill graph run reads past (thinker/prefix.py)."""
        self.blocks, self.penalties, self.kv = kv.blocks, penalties, kv
        self.max_batch_size, self.token_budget, self.graph_tokens = max_batch_size, token_budget, graph_tokens
        self.max_context = max_context
        self.waiting: deque[ThinkerSeq] = deque()
        self.running: list[ThinkerSeq] = []

    def room(self, seq: ThinkerSeq, n: int) -> bool:
        """KV blocks for `n` more rows and then (the prompt whole) a penalty row."""
        if seq.slot < 0 and not seq.open and not self.penalties.num_free:
            return False
        if not self.kv.grant(seq.req.request_id, seq.num_computed + n):
            return False
        if seq.slot < 0 and not seq.open:
            seq.slot = self.penalties.acquire(seq.prompt_ids)
        return True

    def schedule(self) -> list[tuple[ThinkerSeq, int]]:
        """(seq, new tokens) for this step: every running decode, then prefill chunks within the budget (room
        for their next rows made first: `KvGrowth.make_room`)."""
        self.kv.make_room({s.req.request_id: self._next_blocks(s) for s in self.running
                           if s.req.request_id not in self.kv.swapped})
        running = [s for s in self.running if s.req.request_id not in self.kv.swapped]
        batch: list[tuple[ThinkerSeq, int]] = []
        for s in running:
            if len(batch) == self.max_batch_size:
                break
            if self._decodes(s) and self.room(s, 1):
                batch.append((s, 1))
        budget, context = self.token_budget - len(batch), 0
        for seq in [s for s in running if s.in_prefill and s.rows_ready]:  # an open prompt may have none
            if budget <= 0 or len(batch) >= self.max_batch_size or self._past_context(seq, context, batch):
                return batch
            n = min(seq.rows_ready, budget)
            if self.room(seq, n):
                batch.append((seq, n))
                budget, context = budget - n, context + seq.num_computed
        while self.waiting and not self.kv.swapped and budget > 0 and len(batch) < self.max_batch_size:
            seq = self.waiting[0]
            take_prefix(self.blocks, seq, self.graph_tokens, self.max_context)
            # NOTE: a prompt is split only when no other prefill shares the step: its later chunks run eagerly
            # (the prefill graphs take fresh prompts only), a 4096-token step 126 ms against 18.5 under load.
            split = seq.rows_ready > budget and any(s.in_prefill for s, _ in batch)
            if split or self._past_context(seq, context, batch) or not self.room(seq, seq.rows_ready):
                break
            seq.req.mark("thinker_start")
            self.running.append(self.waiting.popleft())
            n = min(seq.rows_ready, budget)
            batch.append((seq, n))
            budget, context = budget - n, context + seq.num_computed
        return batch

    @staticmethod
    def _decodes(s: ThinkerSeq) -> bool:
        # NOTE: a request whose last launched token reaches max_tokens waits for that step's completion (its end)
        return not s.in_prefill and s.num_sampled < s.req.sampling.max_tokens

    def _next_blocks(self, s: ThinkerSeq) -> int:
        """The blocks `s`'s next rows take: its decode row's, or its next prefill chunk's."""
        n = 1 if self._decodes(s) else min(s.rows_ready, self.token_budget) if s.in_prefill else 0
        return self.blocks.blocks_needed(s.req.request_id, s.num_computed + n)

    def _past_context(self, seq: ThinkerSeq, context: int, batch: list[tuple[ThinkerSeq, int]]) -> bool:
        """Whether `seq`'s cached rows would take the step's prefill chunks (`context` of them so far) past
        what one prefill graph run reads; the step's first chunk goes whatever its path."""
        return (0 < self.max_context < context + seq.num_computed) and any(s.in_prefill for s, _ in batch)

    def release(self, seq: ThinkerSeq) -> None:
        """Its penalty row and KV blocks back; out of the queues."""
        seq.released = True
        if seq.slot >= 0:
            self.penalties.release(seq.slot)
            seq.slot = -1
        self.kv.release(seq.req.request_id)
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
