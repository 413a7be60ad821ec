"""Code2Wav's per-request stream (`WavSeq`) and a launched chunk step (`Launched`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from omnistage.engine.request import Request
from omnistage.layers.context import HostCopy
from omnistage.models.qwen3_omni.code2wav_stream import StreamState


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
