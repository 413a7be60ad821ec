"""A request's state in the thinker stage, what each new token does to its text, and a launched step."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from omnistage.engine.detokenizer import IncrementalDetokenizer
from omnistage.engine.request import Request
from omnistage.layers.context import HostCopy
from omnistage.models.qwen3_omni.decoder import Deepstack
from omnistage.models.qwen3_omni.rope_index import MRope


@dataclass
class ThinkerSeq:
    req: Request
    prompt_ids: torch.Tensor  # [L], on the host
    embeds: torch.Tensor  # [L, H]
    mm_mask: torch.Tensor  # [L] bool, on the host
    detok: IncrementalDetokenizer
    has_mm: bool = False  # the prompt has multimodal placeholders (the talker needs their hidden rows)
    open: bool = False  # the prompt may still grow (`PromptPiece`): prefill what is there, never sample
    num_computed: int = 0
    num_sampled: int = 0  # tokens launched (with asynchronous output, one step ahead of `output_ids`)
    slot: int = -1  # its row of the stage's `PenaltyTable` while running
    released: bool = False  # finished or aborted: a launched step's token for it is dropped
    emitted: int = 0  # characters of detok.text already streamed
    output_ids: list[int] = field(default_factory=list)
    mm_hidden: list[torch.Tensor] = field(default_factory=list)
    mrope: MRope | None = None  # 3-D prompt positions (images / videos); None: 1-D
    deepstack: Deepstack | None = None  # visual DeepStack rows at prompt indices `index`
    block_hashes: list[bytes] | None = None  # the prompt's full blocks' (thinker/prefix.py), until registered
    cached_blocks: int = -1  # prompt blocks taken from the prefix cache (-1: not looked up yet)

    @property
    def rope_delta(self) -> float:
        """Decode position of sequence index i (past the prompt) is i + rope_delta on every axis."""
        return 0.0 if self.mrope is None else self.mrope.delta

    @property
    def prompt_len(self) -> int:
        return self.prompt_ids.shape[0]

    @property
    def in_prefill(self) -> bool:
        return self.open or self.num_computed < self.prompt_len

    @property
    def rows_ready(self) -> int:
        """Prompt rows not yet prefilled (an open prompt may have none for now)."""
        return self.prompt_len - self.num_computed

    def append(self, token: int, eos_ids: set[int]) -> tuple[str, bool, bool]:
        """A sampled token -> (new text to stream, stopped, done). Text that could be the start of a stop
        string is held back until it cannot be."""
        self.output_ids.append(token)
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


@dataclass
class Sampled:
    """Rows of a launched step sampled by one run (the decode graph, or the eager step's prefill chunks): their
    tokens and embeddings on the device, and the tokens on their way to the host. Made right after its run is
    launched, so its copy is ready when that run is, before the runs launched after it."""

    seqs: list[ThinkerSeq]
    tokens: torch.Tensor  # [n]
    embeds: torch.Tensor  # [n, H]
    host: HostCopy = field(init=False)

    def __post_init__(self) -> None:
        self.host = HostCopy(self.tokens)


@dataclass
class Launched:
    """A launched thinker step: its runs' sampled rows, in launch order (`parts`)."""

    parts: list[Sampled]

    @classmethod
    def of(cls, parts: list[Sampled]) -> Launched | None:
        return cls(parts) if parts else None

    @property
    def seqs(self) -> list[ThinkerSeq]:
        return [s for p in self.parts for s in p.seqs]

    @property
    def tokens(self) -> torch.Tensor:
        return self.parts[0].tokens if len(self.parts) == 1 else torch.cat([p.tokens for p in self.parts])
