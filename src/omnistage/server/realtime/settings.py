"""A realtime session's settings (the API's `session` object): defaults, `session.update` merged in and
checked, the session object the server sends, and the sampling params of one response.

Audio is `audio/pcm` at 24 kHz both ways (what code2wav makes); `output_modalities` is ["audio"] (audio and
its transcript) or ["text"]. Extensions: `max_audio_frames` (as the chat endpoint's), `seed` (seeds the
thinker and the talker, as chat's `seed`) and `ignore_eos` (the thinker and the talker ignore their end of
turn, as chat's `ignore_eos` and `talker.ignore_eos`: answers of exactly the token / frame caps);
`max_output_tokens` caps the thinker's tokens ("inf": the deploy default). `audio.input.transcription` (null:
off) turns on the user audio's transcripts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from pydantic import Field, StrictBool, ValidationError, field_validator

from omnistage.config import DeployConfig
from omnistage.outputs import NO_AUDIO_OUTPUT
from omnistage.sampling_params import SamplingParams, TalkerSamplingParams
from omnistage.server.errors import OpenAIError
from omnistage.server.protocol import (
    ChatCompletionRequest,
    TalkerParams,
    resolve_voice,
    talker_sampling_params,
    thinker_sampling_params,
)
from omnistage.server.realtime.events import RealtimeError, ResponseParams, _Strict, invalid
from omnistage.utils import deep_merge

DEFAULT_VOICE = "Ethan"


class PcmFormat(_Strict):
    type: Literal["audio/pcm"] = "audio/pcm"
    rate: Literal[24000] = 24000


class TurnDetection(_Strict):
    """server_vad, as the vad module's ServerVad takes it."""

    type: Literal["server_vad"] = "server_vad"
    threshold: float = Field(0.5, ge=0, le=1)
    prefix_padding_ms: int = Field(300, ge=0, le=10_000)
    silence_duration_ms: int = Field(500, ge=0, le=10_000)
    create_response: bool = True
    interrupt_response: bool = True


class InputTranscription(_Strict):
    """Committed user audio transcribed by the served model (transcription.py), whatever `model` names."""

    model: str | None = None
    language: str | None = None
    prompt: str | None = None


class AudioInput(_Strict):
    format: PcmFormat = PcmFormat()
    turn_detection: TurnDetection | None = TurnDetection()
    transcription: InputTranscription | None = None
    noise_reduction: None = None


class AudioOutput(_Strict):
    format: PcmFormat = PcmFormat()
    voice: str = DEFAULT_VOICE
    speed: Literal[1.0] = 1.0


class AudioSettings(_Strict):
    input: AudioInput = AudioInput()
    output: AudioOutput = AudioOutput()


class SessionSettings(_Strict):
    type: Literal["realtime"] = "realtime"
    object: Literal["realtime.session"] | None = None
    id: str | None = None
    model: str | None = None
    instructions: str = ""
    output_modalities: list[Literal["text", "audio"]] = Field(["audio"], min_length=1, max_length=1)
    audio: AudioSettings = AudioSettings()
    max_output_tokens: int | Literal["inf"] = "inf"
    max_audio_frames: int | None = Field(None, ge=1)
    seed: int | None = None
    ignore_eos: StrictBool = False
    tools: list[None] = Field([], max_length=0)
    tool_choice: Literal["auto", "none"] = "auto"

    @field_validator("max_output_tokens")
    @classmethod
    def _positive(cls, v: int | str) -> int | str:
        if isinstance(v, int) and v < 1:
            raise ValueError("must be at least 1 or 'inf'")
        return v


def updated(settings: SessionSettings, patch: dict, voices: Sequence[str],
            model_name: str) -> SessionSettings:
    """`settings` with session.update's `session` merged in (nested objects key by key); a RealtimeError
    names the param (e.g. "session.audio.input.format.rate") and leaves `settings` as they were."""
    try:
        new = SessionSettings.model_validate(deep_merge(settings.model_dump(), patch))
    except ValidationError as e:
        raise invalid(e, ("session",)) from None
    if new.model not in (None, model_name):
        raise RealtimeError(f"session.model: the model `{new.model}` does not exist.", "session.model",
                            "model_not_found")
    if voices:
        new.audio.output.voice = voice(new.audio.output.voice, voices, "session.audio.output.voice")
    elif new.output_modalities == ["audio"]:
        raise RealtimeError(NO_AUDIO_OUTPUT, "session.output_modalities")
    return new


def initial(voices: Sequence[str], model_name: str) -> SessionSettings:
    """A new session's settings: audio out in this checkpoint's spelling of the default voice; text out
    when the checkpoint has no audio output."""
    return updated(SessionSettings(output_modalities=["audio"] if voices else ["text"]), {}, voices,
                   model_name)


def voice(name: str, voices: Sequence[str], param: str) -> str:
    """The voice as the API shows it (the checkpoint's spelling), matched case-insensitively."""
    try:
        lower = resolve_voice(name, voices, param)
    except OpenAIError as e:
        raise RealtimeError(e.message, param) from None
    return next(v for v in voices if v.lower() == lower)


def session_object(settings: SessionSettings, session_id: str, model_name: str) -> dict:
    unset = {k for k, v in (("seed", settings.seed is None), ("ignore_eos", not settings.ignore_eos)) if v}
    return {**settings.model_dump(exclude=unset),
            "object": "realtime.session", "id": session_id, "model": model_name}


class Resolved:
    """One response's settings: the session's, overridden by response.create's `response`."""

    def __init__(self, settings: SessionSettings, params: ResponseParams, voices: Sequence[str]) -> None:
        out = params.audio.output if params.audio and params.audio.output else None
        if out is not None and out.format not in (None, PcmFormat().model_dump()):
            try:
                PcmFormat.model_validate(out.format)
            except ValidationError as e:
                raise invalid(e, ("response", "audio", "output", "format")) from None
        self.instructions = settings.instructions if params.instructions is None else params.instructions
        self.modalities = params.output_modalities or settings.output_modalities
        if self.wants_audio and not voices:
            raise RealtimeError(NO_AUDIO_OUTPUT, "response.output_modalities")
        self.voice = (voice(out.voice, voices, "response.audio.output.voice") if out and out.voice and voices
                      else settings.audio.output.voice)
        self.max_output_tokens = (settings.max_output_tokens if params.max_output_tokens is None
                                  else params.max_output_tokens)
        if isinstance(self.max_output_tokens, int) and self.max_output_tokens < 1:
            raise RealtimeError("response.max_output_tokens: must be at least 1 or 'inf'",
                                "response.max_output_tokens")
        self.max_audio_frames = params.max_audio_frames or settings.max_audio_frames
        self.seed = settings.seed if params.seed is None else params.seed
        self.ignore_eos = settings.ignore_eos if params.ignore_eos is None else params.ignore_eos

    @property
    def wants_audio(self) -> bool:
        return self.modalities == ["audio"]

    def sampling(self, deploy: DeployConfig) -> tuple[SamplingParams, TalkerSamplingParams | None]:
        """The thinker's and talker's params, resolved by the chat endpoint's own functions (as a chat
        request with these fields would be)."""
        fields = ChatCompletionRequest.model_construct(
            max_tokens=None if self.max_output_tokens == "inf" else self.max_output_tokens, seed=self.seed,
            max_audio_frames=self.max_audio_frames, ignore_eos=self.ignore_eos or None,
            talker=TalkerParams(ignore_eos=True) if self.ignore_eos else None)
        try:
            sampling = thinker_sampling_params(fields, deploy.stages.thinker.sampling)
            talker = (talker_sampling_params(fields, deploy.stages.talker.sampling) if self.wants_audio
                      else None)
        except OpenAIError as e:
            raise RealtimeError(e.message, e.param) from None
        return sampling, talker
