"""A request as the stages see it: prompt, per-stage sampling, voice, modalities and its output sink."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from omnistage.models.qwen3_omni.prompt import PromptInputs
from omnistage.outputs import OutputDelta, Usage
from omnistage.sampling_params import SamplingParams, TalkerSamplingParams


@dataclass
class Request:
    request_id: str
    prompt: PromptInputs
    sampling: SamplingParams
    talker_sampling: TalkerSamplingParams
    seed: int  # resolved: the request's own seed or a fresh random one
    emit: Callable[[OutputDelta], None]
    voice: str = "Ethan"
    want_audio: bool = False
    usage: Usage = field(default_factory=Usage)
    finish_reason: str | None = None
    aborted: bool = False

    def finish(self) -> None:
        """The last item of the stream (after every stage the request uses is done)."""
        self.emit(OutputDelta(self.request_id, finished=True, finish_reason=self.finish_reason or "stop",
                              usage=self.usage))
