"""The talker's admissions (a mixin of `TalkerStage`): the thinker's chunks from its inbox; each request's first one
(with the talker prompt) admitted as a `TalkerSeq`, then its tokens' rows queued on it. A prompt sent at the
thinker's admission (pipeline/thinker/early_prompt.py) is admitted without its last row, which its first token's
chunk brings."""

from __future__ import annotations

import torch

from omnistage.models.qwen3_omni.talker_prompt import prompt_mrope
from omnistage.models.qwen3_omni.talker_prompt_rows import (
    PromptSource,
    first_token_row,
    prompt_embeds_batch,
    prompt_source,
)
from omnistage.pipeline.connector import TextChunk, arrive
from omnistage.pipeline.faults import together
from omnistage.pipeline.talker.prefix import prompt_hashes
from omnistage.pipeline.talker.seq import TalkerSeq


class TalkerAdmission:
    """Reads the stage's inbox, talker, tokens, device, dtype, seqs, scheduler, blocks, faults and prefix_caching."""

    @torch.no_grad()
    def _receive(self) -> None:
        chunks = [c for c in self.inbox.drain() if not c.request.aborted]
        for chunk in chunks:
            if chunk.embed is not None:
                chunk.embed = arrive(chunk.embed, self.device)
        # NOTE: a prompt sent early and drained with its first token: admitted once, whole, in the early one's place
        prompts = {c.request.request_id: c for c in chunks if c.prompt is not None}
        # NOTE: admissions first: a request's first chunk may be drained together with its next ones
        self._admit_all([c for c in prompts.values() if self.faults.run(c.request, self._first_token, c) is False])
        for chunk in chunks:
            if chunk.prompt is None and (seq := self.seqs.get(chunk.request.request_id)) is not None:
                if chunk.finished:
                    seq.thinker_done = True
                else:
                    seq.texts.append(chunk.embed)
                    seq.num_texts += 1

    def _first_token(self, chunk: TextChunk) -> bool:
        """The first token's row to its request admitted early; False: no such request (admit it now)."""
        seq = self.seqs.get(chunk.request.request_id)
        if chunk.embed is None or seq is None or not seq.awaiting:
            return False
        seq.take_first_token(first_token_row(self.talker, self.tokens, chunk.embed.to(self.dtype)))
        return True

    def _admit_all(self, chunks: list[TextChunk]) -> None:
        """Admits requests in arrival order: each prompt checked alone, then all their rows built together
        (each alone when that fails, so that only the one at fault fails)."""
        for chunk in chunks:
            chunk.request.mark("talker_start")
        checked = [(c, s) for c in chunks if (s := self.faults.run(c.request, self._source, c)) is not None]
        sources = [s for _, s in checked]
        rows = together(prompt_embeds_batch, self.talker, self.tokens, sources) if len(sources) > 1 else None
        for i, (chunk, source) in enumerate(checked):
            self.faults.run(chunk.request, self._admit, chunk, source, rows and rows[i])

    def _source(self, chunk: TextChunk) -> PromptSource:
        p = chunk.prompt
        mm = None if p.mm_hidden is None else arrive(p.mm_hidden, self.device).to(self.dtype)
        embeds = arrive(p.embeds, self.device, p.ready).to(self.dtype)
        # NOTE: sent early, a prompt has no first token yet: its row is built from a placeholder and dropped
        first = embeds.new_zeros(embeds.shape[1]) if chunk.embed is None else chunk.embed.to(self.dtype)
        return prompt_source(self.tokens, p.prompt_ids, embeds, mm, first,  # NOTE: host ids: no sync
                             chunk.request.voice)

    def _admit(self, chunk: TextChunk, source: PromptSource, rows: torch.Tensor | None) -> None:
        """`rows`: the request's prompt rows when built with others; else built here."""
        req, early = chunk.request, chunk.embed is None
        rows = prompt_embeds_batch(self.talker, self.tokens, [source])[0] if rows is None else rows
        seq = TalkerSeq(req, rows[:-1] if early else rows, awaiting=early,
                        mrope=prompt_mrope(self.tokens, chunk.prompt.prompt_ids, req.prompt))
        if self.prefix_caching:
            seq.block_hashes = prompt_hashes(chunk.prompt.prompt_ids, req.prompt, self.tokens,
                                             self.blocks.block_size, chunk.prompt.mm_hidden is not None)
        self.scheduler.add(seq)
