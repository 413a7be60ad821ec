"""The thinker's admissions (a mixin of `ThinkerStage`): what arrived in its inbox, within the step's media budget,
through the encoders (`arrivals`: on their own stream where `encoder_stream`), then each request admitted to
`waiting` as a `ThinkerSeq` and each prompt piece applied to its growing request."""

from __future__ import annotations

import torch

from omnistage.engine.request import Request
from omnistage.models.qwen3_omni.prompt import PromptInputs
from omnistage.pipeline.thinker.arrivals import Arrival, media_tokens, take_within
from omnistage.pipeline.thinker.early_prompt import early_prompt
from omnistage.pipeline.thinker.growth import PromptPiece, extend, piece_rows
from omnistage.pipeline.thinker.inputs import Media, encode_media, encode_together, new_seq
from omnistage.pipeline.thinker.prefix import prompt_hashes
from omnistage.pipeline.thinker.seq import ThinkerSeq


class ThinkerAdmission:
    """Reads the stage's inbox, queued, arrivals, encoders (thinker, vision, audio, encoder_cache), faults,
    waiting / running, `_release`, and `to_talker` with `early_talker_prompt`."""

    def _take_arrivals(self) -> None:
        """What arrived (within the media budget) through the encoders (`_encode`), what finished there admitted
        (`_arrive`)."""
        budget = self.max_encoder_tokens
        self.queued.extend((item, media_tokens(item, self.mm_ids) if budget else 0) for item in self.inbox.drain())
        if self.queued:
            self.arrivals.add(self._encode(take_within(self.queued, budget)))
        for arrival in self.arrivals.ready(wait=not (self.waiting or self.running)):
            self._arrive(arrival)

    def _encode(self, items: list[Request | PromptPiece]) -> Arrival:
        """The encoders launched for what arrived: all requests' media at once (each alone if that fails, so
        that only the one at fault fails), the pieces' audio."""
        reqs = [r for r in items if isinstance(r, Request) and not r.aborted]
        pieces = [p for p in items if isinstance(p, PromptPiece) and not p.request.aborted]
        prompts = [r.prompt for r in reqs]  # NOTE: read once: a far copy's is renewed on another thread
        with self.arrivals.encoding():
            media = encode_together(self.thinker, prompts, self.device, self.dtype, self.encoder_cache, self.vision,
                                    self.audio)
            media = media or [self.faults.run(r, self._encode_one, p) for r, p in zip(reqs, prompts)]
            rows = piece_rows(self.thinker, pieces, self.device, self.dtype, self.audio)
        return Arrival(reqs, prompts, media, pieces, rows)

    def _arrive(self, arrival: Arrival) -> None:
        """Its requests admitted, then its pieces applied."""
        for req, prompt, media in zip(arrival.reqs, arrival.prompts, arrival.media):
            if media is not None and not req.aborted and \
                    (seq := self.faults.run(req, self._admit, req, prompt, media)) is not None:
                self.waiting.append(seq)
                if self.early_talker_prompt and (chunk := early_prompt(seq)) is not None:
                    self.to_talker(chunk)
        for piece, rows in zip(arrival.pieces, arrival.rows):
            if not piece.request.aborted:
                self.faults.run(piece.request, self._grow, piece, rows)

    def _admit(self, req: Request, prompt: PromptInputs | None = None, media: Media | None = None) -> ThinkerSeq:
        """`media`: `prompt`'s encoder rows (`_encode`); None: encoded here (a prompt started over, `_grow`)."""
        prompt = req.prompt if prompt is None else prompt  # NOTE: read once: a far copy's is renewed on another thread
        if media is None:
            with self.arrivals.encoding_now():
                media = self._encode_one(prompt)
        seq = new_seq(self.thinker, req, prompt, media, self.tokenizer, self.rope)
        req.mark("encoded")
        seq.open = req.growing
        if self.prefix_caching:
            seq.block_hashes = prompt_hashes(seq, prompt.media_keys, self.blocks.block_size)
        return seq

    def _grow(self, piece: PromptPiece, rows: torch.Tensor | None = None) -> None:
        seq = next((s for s in [*self.waiting, *self.running] if s.req is piece.request), None)
        if seq is None:  # aborted (or failed) meanwhile
            return
        if piece.restart:
            self._release(seq)
            piece.request.growing = not piece.closed
            self.waiting.append(self._admit(piece.request))
        else:
            extend(self.thinker, seq, piece, self.tokenizer, rows)
            if piece.closed and self.prefix_caching:  # the whole prompt's blocks are registered at its first token
                seq.block_hashes = prompt_hashes(seq, piece.request.prompt.media_keys, self.blocks.block_size)

    def _encode_one(self, prompt: PromptInputs) -> Media:
        return encode_media(self.thinker, [prompt], self.device, self.dtype, self.encoder_cache, self.vision,
                            self.audio)[0]
