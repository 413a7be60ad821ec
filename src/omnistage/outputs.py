"""What a request's output stream carries: deltas of text and audio, then a finish with usage."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

SAMPLE_RATE = 24000
NO_AUDIO_OUTPUT = ("this model has no audio output (a thinker-only checkpoint: enable_audio_output is false "
                   "in its config.json); ask for text only")


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    audio_frames: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class OutputDelta:
    """One item of a request's output stream. `audio` holds new float32 mono samples at 24 kHz."""

    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    audio: np.ndarray | None = None
    codes: np.ndarray | None = None  # [num_code_groups, n] the codec frames `audio` was decoded from
    finished: bool = False
    finish_reason: str | None = None
    usage: Usage | None = None
    phases: dict[str, float] | None = None  # on the finishing delta: seconds from arrival to each phase reached
