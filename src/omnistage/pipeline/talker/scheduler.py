"""The talker's scheduler: which requests each step runs, over the admitted requests' `TalkerSeq`s.

Room first for the running requests' next rows (engine/kv_growth.py: the newest swapped out while KV blocks run
out), then waiting requests in arrival order (their cached prefix taken first) while none is swapped out and
blocks are left beyond that room (their prompt's blocks and a penalty row taken at once); with `lookahead` the room
is each running request's next `lookahead` frames (a swapped-out stream's audio pauses: a late first frame for
the newcomer instead, as SGLang reserves for its running requests' decode tokens), then each running
request's prompt rows, or its next frame once its text row is there (a row refused a block waits a step), within
`max_num_batched_tokens` rows a step (a step's first prompt goes whatever its length); `release` gives them back."""

from __future__ import annotations

from collections import deque

import torch

from omnistage.engine.kv_growth import KvGrowth
from omnistage.engine.penalty_table import PenaltyTable
from omnistage.models.qwen3_omni.talker_prompt_rows import ASSISTANT_ROWS
from omnistage.pipeline.talker.prefix import take_prefix
from omnistage.pipeline.talker.seq import TalkerSeq

Text = tuple[torch.Tensor | None, bool]  # a frame's text row input (`TalkerSeq.next_text`)


class TalkerScheduler:
    def __init__(self, kv: KvGrowth, penalties: PenaltyTable, max_batch_size: int,
                 max_num_batched_tokens: int = 8192, lookahead: int = 0) -> None:
        self.kv, self.blocks, self.penalties, self.max_batch_size = kv, kv.blocks, penalties, max_batch_size
        self.max_num_batched_tokens, self.lookahead = max_num_batched_tokens, lookahead
        self.seqs: dict[str, TalkerSeq] = {}  # admitted (running once it has a penalty row), in arrival order
        self.waiting: deque[TalkerSeq] = deque()

    def add(self, seq: TalkerSeq) -> None:
        self.seqs[seq.req.request_id] = seq
        self.waiting.append(seq)

    def schedule(self) -> tuple[list[tuple[TalkerSeq, torch.Tensor]], list[tuple[TalkerSeq, Text]]]:
        """(prefills: each with its prompt rows still to compute (one awaiting its first token: those before
        it), decodes: each with its text row)."""
        swapped = self.kv.swapped
        running = [s for s in self.seqs.values() if s.slot >= 0]
        reserve = self.kv.make_room({s.req.request_id: self._next_blocks(s) for s in running
                                     if s.req.request_id not in swapped})
        if self.lookahead and self.waiting and not swapped:
            reserve += sum(self._blocks_ahead(s) for s in running)
        while self.waiting and not swapped:
            seq = self.waiting[0]
            take_prefix(self.blocks, seq, seq.prompt_len - ASSISTANT_ROWS)
            if not (self.penalties.num_free and self.kv.grant(seq.req.request_id, seq.prompt_len, reserve)):
                break
            seq.slot = self.penalties.acquire()
            self.waiting.popleft()
        prefills, decodes, rows = [], [], 0
        for seq in self.seqs.values():
            if (seq.slot < 0 or seq.req.request_id in swapped or len(prefills) + len(decodes) >= self.max_batch_size
                    or seq.frames >= seq.req.talker_sampling.max_frames):  # the last frame is on its way
                continue
            if not seq.prefilled:
                prompt = seq.prompt_rows[seq.num_computed:]
                if not prompt.shape[0]:
                    continue  # awaiting its first token's row
                if prefills and rows + prompt.shape[0] > self.max_num_batched_tokens:
                    continue  # NOTE: a later, shorter prompt may still fit
                prefills.append((seq, prompt))
                rows += prompt.shape[0]
            elif self.kv.grant(seq.req.request_id, seq.num_computed + 1) and (text := seq.next_text()) is not None:
                decodes.append((seq, text))
                rows += 1
        return prefills, decodes

    def release(self, request_id: str) -> None:
        """Its penalty row and KV blocks back; out of the queues."""
        seq = self.seqs.pop(request_id, None)
        if seq is not None and seq in self.waiting:
            self.waiting.remove(seq)
        if seq is not None and seq.slot >= 0:
            self.penalties.release(seq.slot)
        self.kv.release(request_id)

    def _blocks_ahead(self, seq: TalkerSeq) -> int:
        """The blocks its `lookahead` frames after the next take (none past its last frame)."""
        left = seq.req.talker_sampling.max_frames - seq.frames - 1
        if not seq.prefilled or left <= 0:
            return 0
        rid, rows = seq.req.request_id, seq.num_computed + 1
        return self.blocks.blocks_needed(rid, rows + min(self.lookahead, left)) - self.blocks.blocks_needed(rid, rows)

    def _next_blocks(self, seq: TalkerSeq) -> int:
        """The blocks its next row takes (its prompt's are taken at admission)."""
        decodes = seq.prefilled and seq.frames < seq.req.talker_sampling.max_frames
        return self.blocks.blocks_needed(seq.req.request_id, seq.num_computed + 1) if decodes else 0
