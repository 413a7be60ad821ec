"""A request as the stages see it: prompt, per-stage sampling, voice, modalities and its output sink."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from omnistage.models.qwen3_omni.prompt import PromptInputs
from omnistage.outputs import OutputDelta, Usage
from omnistage.sampling_params import SamplingParams, TalkerSamplingParams


@dataclass
class Request:
    """`phases`: seconds from `arrival` (its construction; `AsyncOmni`: when it took the request, before its
    prompt was processed) to the first time the request reached each phase (`mark`: prompt (`AsyncOmni`),
    encoded, thinker_start, first_token, talker_start, first_frame, code2wav_start, first_audio; a realtime
    turn's open request also turn_end (server VAD's decision), close and closed (its closing piece sent), by
    `StreamingPrompt.mark`); the finishing delta carries a copy. With remote replicas the stages mark their copies: `placement: process` merges those
    into the driver's request (one host, one clock); with Ray the driver's request has none."""

    request_id: str
    prompt: PromptInputs
    sampling: SamplingParams
    talker_sampling: TalkerSamplingParams
    seed: int  # resolved: the request's own seed or a fresh random one
    emit: Callable[[OutputDelta], None]
    voice: str = "Ethan"
    want_audio: bool = False
    session: str | None = None  # its conversation's id: the thinker replica of the session's last request
    growing: bool = False  # its prompt grows at its end (`PromptPiece`s) until a closing piece
    usage: Usage = field(default_factory=Usage)
    finish_reason: str | None = None
    aborted: bool = False
    arrival: float = field(default_factory=time.perf_counter, init=False)
    phases: dict[str, float] = field(default_factory=dict, init=False)
    _parts_left: int = field(default=0, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def __post_init__(self) -> None:
        self._parts_left = 2 if self.want_audio else 1  # the text, and the audio when asked

    def mark(self, phase: str) -> None:
        """Records the time since arrival the first time `phase` is reached (later marks do nothing)."""
        if phase not in self.phases:  # NOTE: code2wav marks every chunk: no clock read after the first
            self.phases[phase] = time.perf_counter() - self.arrival

    def part_done(self) -> None:
        """The text (thinker) or the audio (code2wav) is complete; the stream ends after the last part."""
        with self._lock:
            self._parts_left -= 1
            last = self._parts_left == 0
        if last:
            self.emit(OutputDelta(self.request_id, finished=True, finish_reason=self.finish_reason or "stop",
                                  usage=self.usage, phases=dict(self.phases)))
