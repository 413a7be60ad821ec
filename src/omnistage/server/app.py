"""The OpenAI-compatible HTTP server: maps an engine's output stream (OutputDelta) to HTTP, nothing more.

Skeleton against `EngineClient` (below) until the engine lands. Streaming audio goes out as
`delta.audio.data` = base64 raw s16le 24 kHz mono (a "wav" stream: the first chunk opens with a header of
unknown length, so the concatenated chunks are one WAV file).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Protocol

import anyio
import numpy as np
from fastapi import FastAPI
from fastapi.responses import Response, StreamingResponse

from omnistage.config import DeployConfig
from omnistage.outputs import SAMPLE_RATE, OutputDelta, Usage
from omnistage.sampling_params import SamplingParams, TalkerSamplingParams
from omnistage.server.audio_format import AudioStreamEncoder, encode
from omnistage.server.errors import (
    bad_request,
    error_body,
    install_api_key,
    install_error_handlers,
    model_not_found,
)
from omnistage.server.metrics import ServerMetrics, install_metrics
from omnistage.server.protocol import (
    ChatCompletionRequest,
    resolve_voice,
    talker_sampling_params,
    thinker_sampling_params,
)
from omnistage.server.responses import SSE_DONE, ResponseHead, audio_delta, model_list, sse

logger = logging.getLogger(__name__)


class EngineClient(Protocol):
    """What the server needs from the engine (AsyncOmni)."""

    def generate(self, request_id: str, messages: list[dict], sampling: SamplingParams,
                 talker_sampling: TalkerSamplingParams | None, voice: str | None,
                 use_audio_in_video: bool) -> AsyncIterator[OutputDelta]: ...

    async def abort(self, request_id: str) -> None: ...


class _Clock:
    """Per-request times (seconds since arrival) for the metrics."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.ttft: float | None = None
        self.ttfp: float | None = None
        self.last_audio: float | None = None
        self.samples = 0

    def saw(self, delta: OutputDelta) -> None:
        now = time.perf_counter() - self.start
        if delta.text and self.ttft is None:
            self.ttft = now
        if delta.audio is not None and delta.audio.size:
            self.ttfp = now if self.ttfp is None else self.ttfp
            self.last_audio, self.samples = now, self.samples + delta.audio.size

    def report(self, metrics: ServerMetrics) -> None:
        metrics.observe_finished(time.perf_counter() - self.start, self.ttft, self.ttfp,
                                 self.samples / SAMPLE_RATE, self.last_audio)


def create_app(engine: EngineClient, model_name: str, deploy: DeployConfig, voices: Sequence[str],
               api_key: str | None = None, metrics: ServerMetrics | None = None) -> FastAPI:
    app = FastAPI(title="omnistage")
    install_error_handlers(app)
    install_api_key(app, api_key)
    metrics = metrics or ServerMetrics()
    install_metrics(app, metrics)
    started = int(time.time())

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict:
        return model_list([model_name], started)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(req: ChatCompletionRequest) -> Response | dict:
        if req.model not in (None, model_name):
            raise model_not_found(req.model)
        messages = _messages(req)
        sampling = thinker_sampling_params(req, deploy.stages.thinker.sampling)
        talker = talker_sampling_params(req, deploy.stages.talker.sampling) if req.wants_audio else None
        voice = resolve_voice(req.audio.voice, voices) if req.audio else None
        head, clock = ResponseHead(model=model_name), _Clock()
        deltas = engine.generate(head.id, messages, sampling, talker, voice, req.use_audio_in_video)
        if req.stream:
            body = _stream(req, head, deltas, engine, clock, metrics)
            return StreamingResponse(body, media_type="text/event-stream")
        return await _collect(req, head, deltas, engine, clock, metrics)

    return app


def _messages(req: ChatCompletionRequest) -> list[dict]:
    # NOTE: resolving `audio: {id}` history needs a transcript store; until then the client sends the text.
    for i, m in enumerate(req.messages):
        if m.audio is not None and not m.content:
            raise bad_request(f"messages[{i}].audio: audio references are not stored; send the transcript as "
                              "content", f"messages[{i}].audio")
    return [m.model_dump(exclude_none=True, exclude={"audio"}) for m in req.messages]


async def _collect(req: ChatCompletionRequest, head: ResponseHead, deltas: AsyncIterator[OutputDelta],
                   engine: EngineClient, clock: _Clock, metrics: ServerMetrics) -> dict:
    text, audio, last = [], [], OutputDelta(head.id)
    try:
        async for last in deltas:
            clock.saw(last)
            text.append(last.text)
            if last.audio is not None:
                audio.append(last.audio)
    finally:
        await _abort_unfinished(engine, last)
    clock.report(metrics)
    wav = None
    if req.audio:
        wav = encode(np.concatenate(audio) if audio else np.zeros(0, np.float32), req.audio.format)
    return head.completion("".join(text), last.finish_reason or "stop", last.usage or Usage(), wav)


async def _stream(req: ChatCompletionRequest, head: ResponseHead, deltas: AsyncIterator[OutputDelta],
                  engine: EngineClient, clock: _Clock, metrics: ServerMetrics) -> AsyncIterator[str]:
    encoder = AudioStreamEncoder(req.audio.format) if req.audio else None
    audio_id: str | None = head.audio_id
    last = OutputDelta(head.id)
    try:
        yield sse(head.chunk({"role": "assistant", "content": ""}))
        async for last in deltas:
            clock.saw(last)
            if last.text:
                yield sse(head.chunk({"content": last.text}))
            if encoder is not None and last.audio is not None and last.audio.size:
                yield sse(head.chunk(audio_delta(encoder.encode(last.audio), audio_id)))
                audio_id = None
        if encoder is not None:
            yield sse(head.audio_done_chunk())
        yield sse(head.chunk({}, last.finish_reason or "stop"))
        if req.stream_options and req.stream_options.include_usage:
            yield sse(head.usage_chunk(last.usage or Usage()))
        clock.report(metrics)
    except Exception:  # the status line is gone: report in the stream
        logger.exception("request %s failed while streaming", head.id)
        yield sse(error_body("The server had an error while processing your request.", "server_error"))
    finally:
        await _abort_unfinished(engine, last)
    yield SSE_DONE


async def _abort_unfinished(engine: EngineClient, last: OutputDelta) -> None:
    if not last.finished:
        # NOTE: shielded, or a client disconnect (a cancelled scope) would cancel the abort too.
        with anyio.CancelScope(shield=True):
            await engine.abort(last.request_id)
