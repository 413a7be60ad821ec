"""The OpenAI-compatible HTTP server: maps an engine's output stream (OutputDelta) to HTTP, nothing more.

Streaming audio goes out as `delta.audio.data` = base64 raw s16le 24 kHz mono (a "wav" stream: the first
chunk opens with a header of unknown length, so the concatenated chunks are one WAV file).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from omnistage.config import DeployConfig
from omnistage.outputs import OutputDelta, Usage
from omnistage.server.audio_format import AudioStreamEncoder, encode
from omnistage.server.errors import (
    bad_request,
    error_body,
    install_api_key,
    install_body_limit,
    install_error_handlers,
    model_not_found,
)
from omnistage.media import MediaPolicy
from omnistage.server.metrics import ServerMetrics, install_metrics
from omnistage.server.page import install_page
from omnistage.server.protocol import (
    ChatCompletionRequest,
    resolve_voice,
    talker_sampling_params,
    thinker_sampling_params,
)
from omnistage.server.realtime.endpoint import install_realtime
from omnistage.server.realtime.transcripts import TranscriptStore
from omnistage.server.responses import SSE_DONE, ResponseHead, audio_delta, model_list, sse
from omnistage.server.serving import (
    EngineClient,
    RequestClock,
    abort_unfinished,
    check_finished,
    collect,
    start_request,
    until_disconnect,
)
from omnistage.server.speech import install_speech

logger = logging.getLogger(__name__)
CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away first"; only the metrics see it
MAX_BODY_BYTES = 64 << 20  # a request body (base64 media included)


def create_app(engine: EngineClient, model_name: str, deploy: DeployConfig, voices: Sequence[str],
               api_key: str | None = None, metrics: ServerMetrics | None = None, *,
               max_body_bytes: int = MAX_BODY_BYTES,
               model_info: dict | None = None,
               media_policy: MediaPolicy | None = None) -> FastAPI:
    """`model_info`: extra fields of the model's /v1/models entry. Media parts go to the engine as sent: it
    decodes them under its media policy (a MediaError there is a 400); `media_policy` (the engine's; None: the
    default) decodes realtime user images and bounds a realtime session's input audio buffer (its
    max_audio_seconds). `app.state.realtime_vad` is to be closed at shutdown."""
    app = FastAPI(title="omnistage")
    install_error_handlers(app)
    app.add_exception_handler(ClientDisconnect, _client_gone)
    install_api_key(app, api_key)
    install_body_limit(app, max_body_bytes)
    install_page(app)  # NOTE: after install_api_key: its subprotocol key must reach that check as a header
    metrics = metrics or ServerMetrics()
    install_metrics(app, metrics, getattr(engine, "stats", None), getattr(engine, "admission", None))
    install_speech(app, engine, model_name, deploy, voices, metrics)
    transcripts = TranscriptStore()
    app.state.realtime_vad = install_realtime(app, engine, model_name, deploy, voices, transcripts,
                                              media_policy or MediaPolicy(), metrics)
    started = int(time.time())

    @app.get("/health")
    async def health() -> Response:
        error = getattr(engine, "error", None)
        if error is not None:
            return JSONResponse({"status": "error", "error": "a stage has failed; see the server's log"},
                                status_code=503)
        health = getattr(engine, "health", lambda: {"status": "ok", "replicas": {}})()
        if health["status"] == "ok":
            return JSONResponse({"status": "ok"})
        # NOTE: degraded still serves (200): a load balancer keeps sending; unavailable (503) until one is up
        return JSONResponse(health, status_code=200 if health["status"] == "degraded" else 503)

    @app.get("/v1/models")
    async def models() -> dict:
        body = model_list([model_name], started)
        body["data"][0].update(model_info or {})
        return body

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        if model_id != model_name:
            raise model_not_found(model_id)
        return (await models())["data"][0]

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(req: ChatCompletionRequest, request: Request) -> Response | dict:
        if req.model not in (None, model_name):
            raise model_not_found(req.model)
        messages = _messages(req, transcripts)
        sampling = thinker_sampling_params(req, deploy.stages.thinker.sampling)
        talker = talker_sampling_params(req, deploy.stages.talker.sampling) if req.wants_audio else None
        voice = resolve_voice(req.audio.voice, voices) if req.audio else None
        head, clock = ResponseHead(model=model_name), RequestClock()
        deltas = await until_disconnect(request, start_request(engine, head.id, messages, sampling, talker,
                                                               voice, req.use_audio_in_video,
                                                               req.prompt_cache_key))
        if req.stream:
            body = _stream(req, head, deltas, engine, clock, metrics, transcripts)
            return StreamingResponse(body, media_type="text/event-stream")
        answer = _collect(req, head, deltas, engine, clock, metrics, transcripts)
        return await until_disconnect(request, answer)

    return app


def _messages(req: ChatCompletionRequest, transcripts: TranscriptStore) -> list[dict]:
    """The messages as the engine takes them; an assistant turn given as `audio: {id}` (an earlier answer's
    audio id) without content becomes that answer's transcript."""
    messages = [m.model_dump(exclude_none=True, exclude={"audio"}) for m in req.messages]
    for i, m in enumerate(req.messages):
        if m.audio is not None and not m.content:
            transcript = transcripts.get(m.audio.id)
            if transcript is None:
                raise bad_request(f"messages[{i}].audio.id: no audio answer {m.audio.id!r} is stored "
                                  "(unknown or expired)", f"messages[{i}].audio.id")
            messages[i]["content"] = [{"type": "text", "text": transcript}]
    return messages


async def _collect(req: ChatCompletionRequest, head: ResponseHead, deltas: AsyncIterator[OutputDelta],
                   engine: EngineClient, clock: RequestClock, metrics: ServerMetrics,
                   transcripts: TranscriptStore) -> dict:
    text, audio, last = await collect(deltas, engine, head.id, clock)
    clock.report(metrics)
    wav = encode(audio, req.audio.format) if req.audio else None
    if req.audio:
        transcripts.put(head.audio_id, text, head.audio_expires_at)
    return head.completion(text, last.finish_reason or "stop", last.usage or Usage(), wav)


async def _stream(req: ChatCompletionRequest, head: ResponseHead, deltas: AsyncIterator[OutputDelta],
                  engine: EngineClient, clock: RequestClock, metrics: ServerMetrics,
                  transcripts: TranscriptStore) -> AsyncIterator[str]:
    encoder = AudioStreamEncoder(req.audio.format) if req.audio else None
    audio_id: str | None = head.audio_id
    last, text = OutputDelta(head.id), []
    try:
        yield sse(head.chunk({"role": "assistant", "content": ""}))
        async for last in deltas:
            clock.saw(last)
            text.append(last.text)
            if last.text:
                yield sse(head.chunk({"content": last.text}))
            if encoder is not None and last.audio is not None and last.audio.size:
                yield sse(head.chunk(audio_delta(encoder.encode(last.audio), audio_id)))
                audio_id = None
        check_finished(last)
        if encoder is not None:
            transcripts.put(head.audio_id, "".join(text), head.audio_expires_at)
            yield sse(head.audio_done_chunk())
        yield sse(head.chunk({}, last.finish_reason or "stop"))
        if req.stream_options and req.stream_options.include_usage:
            yield sse(head.usage_chunk(last.usage or Usage()))
        clock.report(metrics)
    except Exception:  # the status line is gone: report in the stream
        logger.exception("request %s failed while streaming", head.id)
        yield sse(error_body("The server had an error while processing your request.", "server_error"))
    finally:
        await abort_unfinished(engine, last)
    yield SSE_DONE


async def _client_gone(request: Request, exc: Exception) -> Response:
    return Response(status_code=CLIENT_CLOSED_REQUEST)
