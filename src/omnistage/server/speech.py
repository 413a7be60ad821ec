"""POST /v1/audio/speech: text in, speech out, through the same engine as chat.

The engine is a chat model, so the text goes in as a read-aloud turn: system SPEECH_SYSTEM_PROMPT, user =
the text, modalities text + audio. The thinker is greedy unless `temperature` is given. Extensions as for
chat: seed, max_tokens, max_audio_frames, talker {...}; OpenAI's `instructions` (how to speak) are appended
to the system prompt. `stream: true` (or OpenAI's `stream_format: "audio"`) sends the audio as it is produced:
raw s16le for pcm, a WAV whose header says "unknown length" for wav (other formats stream only whole).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any, Literal

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import Field, model_validator

from omnistage.config import DeployConfig
from omnistage.outputs import OutputDelta
from omnistage.server.audio_format import MEDIA_TYPES, AudioStreamEncoder, encode
from omnistage.server.errors import model_not_found
from omnistage.server.metrics import ServerMetrics
from omnistage.server.protocol import (
    AudioParams,
    ChatCompletionRequest,
    SpeechRequest,
    TalkerParams,
    resolve_voice,
    talker_sampling_params,
    thinker_sampling_params,
)
from omnistage.server.serving import (
    EngineClient,
    RequestClock,
    abort_unfinished,
    check_finished,
    collect,
    start_request,
    until_disconnect,
)

logger = logging.getLogger(__name__)

SPEECH_SYSTEM_PROMPT = ("You are a speech synthesizer. Read the user's text aloud exactly as written, "
                        "without adding or leaving out anything.")


class OmniSpeechRequest(SpeechRequest):
    """OpenAI's speech request plus the chat endpoint's sampling extensions."""

    temperature: float = Field(0.0, ge=0, le=2)
    max_tokens: int | None = Field(None, ge=1)
    seed: int | None = None
    max_audio_frames: int | None = Field(None, ge=1)
    talker: TalkerParams | None = None
    instructions: str | None = None
    stream_format: Literal["audio"] | None = None

    @model_validator(mode="before")
    @classmethod
    def _stream_format(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("stream_format") == "audio":
            return {**data, "stream": True}
        return data

    def messages(self) -> list[dict]:
        system = f"{SPEECH_SYSTEM_PROMPT} {self.instructions}" if self.instructions else SPEECH_SYSTEM_PROMPT
        return [{"role": "system", "content": system}, {"role": "user", "content": self.input}]

    def as_chat(self) -> ChatCompletionRequest:
        """The chat request this speech request runs as (its sampling fields resolve the same way)."""
        return ChatCompletionRequest(
            model=self.model, messages=self.messages(), modalities=["text", "audio"],
            audio=AudioParams(voice=self.voice, format=self.response_format), temperature=self.temperature,
            max_tokens=self.max_tokens, seed=self.seed, max_audio_frames=self.max_audio_frames,
            talker=self.talker)


def install_speech(app: FastAPI, engine: EngineClient, model_name: str, deploy: DeployConfig,
                   voices: Sequence[str], metrics: ServerMetrics) -> None:
    @app.post("/v1/audio/speech", response_model=None)
    async def speech(req: OmniSpeechRequest, request: Request) -> Response:
        if req.model not in (None, model_name):
            raise model_not_found(req.model)
        voice = resolve_voice(req.voice, voices, "voice", asked_by=None)
        chat = req.as_chat()
        sampling = thinker_sampling_params(chat, deploy.stages.thinker.sampling)
        talker = talker_sampling_params(chat, deploy.stages.talker.sampling)
        request_id, clock = f"speech-{uuid.uuid4().hex}", RequestClock()
        deltas = await until_disconnect(request, start_request(engine, request_id, req.messages(), sampling,
                                                               talker, voice))
        media_type = MEDIA_TYPES[req.response_format]
        if req.stream:
            encoder = AudioStreamEncoder(req.response_format, param="response_format")
            body = _stream_audio(deltas, encoder, engine, request_id, clock, metrics)
            return StreamingResponse(body, media_type=media_type)
        _, audio, _ = await until_disconnect(request, collect(deltas, engine, request_id, clock))
        clock.report(metrics)
        return Response(encode(audio, req.response_format), media_type=media_type)


async def _stream_audio(deltas: AsyncIterator[OutputDelta], encoder: AudioStreamEncoder, engine: EngineClient,
                        request_id: str, clock: RequestClock, metrics: ServerMetrics) -> AsyncIterator[bytes]:
    last = OutputDelta(request_id)
    try:
        async for last in deltas:
            clock.saw(last)
            if last.audio is not None and last.audio.size:
                yield encoder.encode(last.audio)
        check_finished(last)
        tail = encoder.encode(np.zeros(0, np.float32))  # a wav header still owed when no audio came
        if tail:
            yield tail
        clock.report(metrics)
    except Exception:  # NOTE: the status line is gone; an unterminated body tells the client it broke
        logger.exception("speech request %s failed while streaming", request_id)
        raise
    finally:
        await abort_unfinished(engine, last)
