"""A request's state in the thinker stage, and what each new token does to its text."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from omnistage.engine.detokenizer import IncrementalDetokenizer
from omnistage.engine.request import Request
from omnistage.layers.sampling import record_tokens
from omnistage.models.qwen3_omni.decoder import Deepstack
from omnistage.models.qwen3_omni.rope_index import MRope


@dataclass
class ThinkerSeq:
    req: Request
    prompt_ids: torch.Tensor  # [L]
    embeds: torch.Tensor  # [L, H]
    mm_mask: torch.Tensor  # [L] bool
    detok: IncrementalDetokenizer
    seen: torch.Tensor | None  # [V] bool, prompt + output (repetition penalty)
    counts: torch.Tensor | None  # [V] int, output only (presence / frequency penalties)
    has_mm: bool = False  # the prompt has multimodal placeholders (the talker needs their hidden rows)
    num_computed: int = 0
    emitted: int = 0  # characters of detok.text already streamed
    output_ids: list[int] = field(default_factory=list)
    mm_hidden: list[torch.Tensor] = field(default_factory=list)
    mrope: MRope | None = None  # 3-D prompt positions (images / videos); None: 1-D
    deepstack: Deepstack | None = None  # visual DeepStack rows at prompt indices `index`

    @property
    def rope_delta(self) -> float:
        """Decode position of sequence index i (past the prompt) is i + rope_delta on every axis."""
        return 0.0 if self.mrope is None else self.mrope.delta

    @property
    def prompt_len(self) -> int:
        return self.prompt_ids.shape[0]

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < self.prompt_len

    def append(self, token: int, t: torch.Tensor, eos_ids: set[int]) -> tuple[str, bool, bool]:
        """Record a sampled token (`t`: it on the device) -> (new text to stream, stopped, done).
        Text that could be the start of a stop string is held back until it cannot be."""
        self.output_ids.append(token)
        record_tokens(t, None if self.seen is None else self.seen[None],
                      None if self.counts is None else self.counts[None])
        sp = self.req.sampling
        self.detok.step(token)
        full = self.detok.text
        # NOTE: a stop string can only start in the held-back tail, so the search cost does not grow.
        stop_at = min((i for i in (full.find(s, self.emitted) for s in sp.stop) if i >= 0), default=-1)
        stopped = stop_at >= 0 or token in sp.stop_token_ids or (token in eos_ids and not sp.ignore_eos)
        done = stopped or len(self.output_ids) >= sp.max_tokens
        hold = max(map(len, sp.stop), default=1) - 1
        end = stop_at if stop_at >= 0 else len(full) if done else len(full) - hold
        text = full[self.emitted:end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return text, stopped, done
