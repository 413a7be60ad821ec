"""A request's state in the talker stage and which text row its next frame takes; a run's batch; a
launched step."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from omnistage.engine.request import Request
from omnistage.layers.context import HostCopy
from omnistage.models.qwen3_omni.rope_index import MRope
from omnistage.pipeline.talker.runner import FrameBatch


@dataclass
class TalkerSeq:
    req: Request
    prompt_rows: torch.Tensor  # [Lp, H]
    awaiting: bool = False  # admitted before the thinker's first token: `prompt_rows` lack its row, the last
    texts: deque[torch.Tensor] = field(default_factory=deque)  # thinker embeds of g_1, g_2, ... not yet used
    num_texts: int = 1  # thinker tokens received (g_0 is in the prompt)
    thinker_done: bool = False
    frames: int = 0  # frames launched (with asynchronous output, one step ahead of those delivered)
    emitted: int = 0  # frames delivered to code2wav
    num_computed: int = 0
    prefilled: bool = False  # its prompt rows launched
    block_hashes: list[bytes] | None = None  # its user rows' prefix-cache keys, until registered (prefix.py)
    cached_blocks: int = -1  # blocks taken from the prefix cache (-1: not looked up yet)
    codec_embed: torch.Tensor | None = None  # [H] of the last frame, waiting for its text row
    mrope: MRope | None = None  # 3-D prompt positions (images / videos); None: 1-D
    slot: int = -1  # its row of the stage's `PenaltyTable` (generated codebook-0 codes) once admitted

    @property
    def prompt_len(self) -> int:
        return self.prompt_rows.shape[0] + self.awaiting

    def take_first_token(self, row: torch.Tensor) -> None:
        """The last prompt row [1, H] (`first_token_row`) of a request admitted before its first token."""
        self.prompt_rows, self.awaiting = torch.cat([self.prompt_rows, row]), False

    def next_text(self) -> tuple[torch.Tensor | None, bool] | None:
        """The text side of the input after the last frame, as `text_rows` takes it (transformers'
        trailing_text_hidden[t]): (embedding of g_{t+1}, False) once g_{t+2} exists, then (None, True)
        once for tts_eos, then (None, False) for tts_pad; None = wait for the thinker."""
        t = self.frames - 1
        if self.num_texts >= t + 3:
            return self.texts.popleft(), False
        if not self.thinker_done:
            return None
        return None, t == max(self.num_texts - 2, 0)


@dataclass
class Run:
    """One run of a launched talker step: its seqs and input rows, frames [B, G] on the device, and codebook 0 on
    its way to the host. Made right after its run is launched, so its copy is ready before the runs after it."""

    group: list[tuple[TalkerSeq, torch.Tensor]]
    frames: torch.Tensor
    c0: HostCopy = field(init=False)

    def __post_init__(self) -> None:
        self.c0 = HostCopy(self.frames[:, 0])


@dataclass
class Launched:
    """A launched talker step: its runs in launch order (prompts, then one-row inputs)."""

    runs: list[Run]


def frame_batch(batch: list[tuple[TalkerSeq, torch.Tensor]], tables: dict[str, list[int]]) -> FrameBatch:
    """One run's requests and their input rows as the runner (or the eager head) takes them."""
    seqs = [s for s, _ in batch]
    return FrameBatch(torch.cat([r for _, r in batch]), [r.shape[0] for _, r in batch],
                      [s.num_computed for s in seqs], [tables[s.req.request_id] for s in seqs],
                      [s.req.talker_sampling for s in seqs], [s.req.seed + 1 for s in seqs],
                      [s.frames for s in seqs], [s.slot for s in seqs], [s.mrope for s in seqs])
