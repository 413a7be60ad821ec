"""Code2Wav's per-request stream (`WavSeq`) and a launched chunk step (`Launched`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from omnistage.engine.request import Request
from omnistage.layers.context import HostCopy
from omnistage.models.qwen3_omni.code2wav_stream import StreamState

SLOW_START_S = 0.04  # half a frame's audio: packet growth needs frames at twice real time


@dataclass
class WavSeq:
    req: Request
    state: StreamState
    initial: int  # its first packet's frames
    pending: list[torch.Tensor] = field(default_factory=list)  # frames [G] not launched yet
    done: bool = False  # the talker sent its last frame
    in_flight: int = 0  # chunks launched whose samples are not emitted yet
    dry_at: float | None = None  # when its emitted audio, played in real time from its first chunk, runs out
    chunk: tuple[int, int] = (0, 0)  # (frames, shape) of the chunk `_schedule` picked for this step, if any
    first_made_at: float = 0.0  # when the talker made its first frame

    def take(self, frame: torch.Tensor, made_at: float, slow_initial: int) -> None:
        """A frame; before its first packet, a slow start (its first two frames made more than SLOW_START_S
        apart) makes that packet at least `slow_initial` frames."""
        self.pending.append(frame)
        if self.state.frames or len(self.pending) > 2:
            return
        if len(self.pending) == 1:
            self.first_made_at = made_at
        elif made_at - self.first_made_at > SLOW_START_S:
            self.initial = max(self.initial, slow_initial)

    @property
    def ended(self) -> bool:
        """Every frame decoded and its samples emitted."""
        return self.done and not self.pending and not self.in_flight


@dataclass
class Launched:
    """A launched chunk step: its requests, each chunk's samples and frames, and the step's samples and
    codes on their way to the host."""

    seqs: list[WavSeq]
    samples: list[int]
    frames: list[int]
    codes: torch.Tensor  # [sum frames, Q] on the host once `audio` is
    audio: HostCopy

    def wait(self) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """Per chunk its samples and its codes [n, Q] (waits for the step: the one host sync)."""
        return self.audio.wait().split(self.samples), self.codes.split(self.frames)
