"""OpenAI-compatible requests (+ documented extensions) and their conversion to sampling params.

Extensions to OpenAI's chat request: top_k, min_p, repetition_penalty, stop_token_ids, ignore_eos,
use_audio_in_video (also as `mm_processor_kwargs.use_audio_in_video`), max_audio_frames, and a `talker` block
(codec sampling; top-level `seed` seeds it too). Media parts: OpenAI's and the Qwen-native `image` / `audio` /
`video` keys, each with qwen-omni-utils' per-item knobs; the engine decodes them (omnistage.media).
Sampling = deploy defaults (`stages.<stage>.sampling`) overridden by the fields a request sets.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator, model_validator

from omnistage.outputs import NO_AUDIO_OUTPUT
from omnistage.sampling_params import SamplingParams, TalkerSamplingParams, from_dict
from omnistage.server.audio_format import AudioFormat, check_format
from omnistage.server.errors import bad_request


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Media(_Strict):
    """Per-part knobs of qwen-omni-utils."""

    fps: float | None = Field(None, gt=0)
    nframes: int | None = Field(None, ge=1)
    min_frames: int | None = Field(None, ge=1)
    max_frames: int | None = Field(None, ge=1)
    min_pixels: int | None = Field(None, ge=1)
    total_pixels: int | None = Field(None, ge=1)
    max_pixels: int | None = Field(None, ge=1)
    resized_height: int | None = Field(None, ge=1)
    resized_width: int | None = Field(None, ge=1)
    audio_start: float | None = Field(None, ge=0)
    audio_end: float | None = Field(None, ge=0)
    video_start: float | None = Field(None, ge=0)
    video_end: float | None = Field(None, ge=0)


class URL(_Strict):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class InputAudio(_Strict):
    data: str
    format: str


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImageURLPart(_Media):
    type: Literal["image_url"]
    image_url: URL


class InputAudioPart(_Media):
    type: Literal["input_audio"]
    input_audio: InputAudio


class AudioURLPart(_Media):
    type: Literal["audio_url"]
    audio_url: URL


class VideoURLPart(_Media):
    type: Literal["video_url"]
    video_url: URL


class AudioPart(_Media):
    type: Literal["audio"]
    audio: str


class ImagePart(_Media):
    type: Literal["image"]
    image: str


class VideoPart(_Media):
    type: Literal["video"]
    video: str | list[str]


ContentPart = Annotated[
    TextPart | ImageURLPart | InputAudioPart | AudioURLPart | VideoURLPart | AudioPart | ImagePart
    | VideoPart,
    Field(discriminator="type"),
]


class AudioRef(_Strict):
    id: str


class ChatMessage(_Strict):
    """`content` is always a list of parts (a string becomes one text part); `audio` references a previous
    audio answer by id (assistant history)."""

    role: Literal["system", "user", "assistant", "tool"]
    content: list[ContentPart] | None = None
    name: str | None = None
    audio: AudioRef | None = None
    tool_call_id: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_to_part(cls, v: Any) -> Any:
        return [{"type": "text", "text": v}] if isinstance(v, str) else v

    @model_validator(mode="after")
    def _check_role(self) -> ChatMessage:
        if self.role != "user" and any(p.type != "text" for p in self.content or []):
            raise ValueError(f"{self.role} messages take text content only")
        if self.audio is not None and self.role != "assistant":
            raise ValueError("only assistant messages reference audio")
        if self.content is None and self.audio is None:
            raise ValueError("content is required")
        return self


class AudioParams(_Strict):
    voice: str = "Ethan"
    format: AudioFormat = "wav"

    @field_validator("format")
    @classmethod
    def _available(cls, v: str) -> str:
        return check_format(v)


class MMProcessorKwargs(_Strict):
    use_audio_in_video: StrictBool | None = None


class StreamOptions(_Strict):
    include_usage: StrictBool = False


class TalkerParams(_Strict):
    temperature: float | None = Field(None, ge=0)
    top_k: int | None = Field(None, ge=-1)
    top_p: float | None = Field(None, gt=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    max_frames: int | None = Field(None, ge=1)
    ignore_eos: StrictBool | None = None
    seed: int | None = None


class ChatCompletionRequest(_Strict):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    modalities: list[Literal["text", "audio"]] = Field(default_factory=lambda: ["text"], min_length=1)
    audio: AudioParams | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    seed: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = Field(1, ge=1)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    prompt_cache_key: str | None = Field(None, max_length=1024)  # requests sharing one go to one thinker replica
    ignore_eos: StrictBool | None = None
    use_audio_in_video: StrictBool = False
    mm_processor_kwargs: MMProcessorKwargs | None = None
    max_audio_frames: int | None = Field(None, ge=1)
    talker: TalkerParams | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    @field_validator("modalities")
    @classmethod
    def _text_with_audio(cls, v: list[str]) -> list[str]:
        return ["text", "audio"] if "audio" in v else ["text"]

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if self.audio is not None and not self.wants_audio:
            raise bad_request("audio: given, but modalities does not include 'audio'", "audio")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options: only allowed when stream is true", "stream_options")
        mm = self.mm_processor_kwargs.use_audio_in_video if self.mm_processor_kwargs else None
        if mm is not None and "use_audio_in_video" in self.model_fields_set and mm != self.use_audio_in_video:
            raise bad_request("mm_processor_kwargs.use_audio_in_video: differs from use_audio_in_video",
                              "mm_processor_kwargs.use_audio_in_video")
        self.use_audio_in_video = self.use_audio_in_video if mm is None else mm
        if self.max_audio_frames is not None and self.talker and self.talker.max_frames is not None:
            raise bad_request("max_audio_frames: give it or talker.max_frames, not both", "max_audio_frames")
        if self.n != 1:  # a 400 rather than fewer choices than asked for
            raise bad_request("n: only 1 is supported (one choice a request)", "n")
        if self.wants_audio:
            self.audio = self.audio or AudioParams()
            if self.stream:
                check_format(self.audio.format, stream=True)
        return self

    @property
    def wants_audio(self) -> bool:
        return "audio" in self.modalities


class SpeechRequest(_Strict):
    """POST /v1/audio/speech. Default format wav (OpenAI's is mp3); only speed 1.0."""

    model: str | None = None
    input: str = Field(min_length=1)
    voice: str = "Ethan"
    response_format: AudioFormat = "wav"
    speed: float = 1.0
    stream: StrictBool = False

    @field_validator("speed")
    @classmethod
    def _speed_one(cls, v: float) -> float:
        if v != 1.0:
            raise ValueError(f"only 1.0 is supported, got {v}")
        return v

    @model_validator(mode="after")
    def _check(self) -> SpeechRequest:
        check_format(self.response_format, self.stream, param="response_format")
        return self


_THINKER_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "seed", "stop", "stop_token_ids", "ignore_eos")


def thinker_sampling_params(req: ChatCompletionRequest, defaults: dict) -> SamplingParams:
    values = {**defaults, **{k: getattr(req, k) for k in _THINKER_FIELDS if getattr(req, k) is not None}}
    max_tokens = req.max_completion_tokens or req.max_tokens
    if max_tokens is not None:
        values["max_tokens"] = max_tokens
    return _build(SamplingParams, values)


def talker_sampling_params(req: ChatCompletionRequest, defaults: dict) -> TalkerSamplingParams:
    given = req.talker.model_dump(exclude_none=True) if req.talker else {}
    if req.max_audio_frames is not None:
        given["max_frames"] = req.max_audio_frames
    if req.seed is not None:
        given.setdefault("seed", req.seed)
    return _build(TalkerSamplingParams, {**defaults, **given})


def resolve_voice(voice: str, voices: Iterable[str], param: str = "audio.voice",
                  asked_by: str | None = "modalities") -> str:
    """The checkpoint's speaker name (lower case) for `voice`, matched case-insensitively. No voices: the
    checkpoint has no audio output, and asking for audio (`asked_by`) is the error."""
    known = sorted(v.lower() for v in voices)
    if not known:
        raise bad_request(NO_AUDIO_OUTPUT, asked_by)
    if voice.lower() not in known:
        raise bad_request(f"{param}: unknown voice {voice!r}; available: {', '.join(known)}", param)
    return voice.lower()


def _build(cls: type, values: dict) -> Any:
    try:
        return from_dict(cls, values)
    except ValueError as e:
        raise bad_request(str(e)) from None
