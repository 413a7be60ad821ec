"""GET /v1/realtime (WebSocket): the OpenAI Realtime API (GA events), one RealtimeSession per socket.

`?model=` is the served model's name (or absent). The session's events go out through a bounded send queue
(backpressure: a response waits while the client does not read); client events are handled in order. The
server VAD (one VadEngine for all sessions, made on first use) batches every session's audio windows.
`--api-key` is checked at the handshake (errors.install_api_key: a 401 before the upgrade).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Sequence
from fastapi import FastAPI, WebSocket

from omnistage.config import DeployConfig
from omnistage.media import MediaPolicy
from omnistage.outputs import SAMPLE_RATE
from omnistage.server.metrics import ServerMetrics
from omnistage.server.realtime.events import RealtimeError, error_event
from omnistage.server.realtime.session import RealtimeSession, SessionContext
from omnistage.server.realtime.settings import TurnDetection
from omnistage.server.realtime.transcripts import TranscriptStore
from omnistage.server.realtime.vad import ServerVad, TurnDetector, VadEngine
from omnistage.server.serving import EngineClient

logger = logging.getLogger(__name__)
SEND_QUEUE = 256  # server events waiting for a socket
POLICY_VIOLATION = 1008


class Vad:
    """The server's VadEngine, started when the first session turns server_vad on."""

    def __init__(self) -> None:
        self.engine: VadEngine | None = None

    def detector(self, settings: TurnDetection) -> TurnDetector:
        if self.engine is None:
            self.engine = VadEngine()
        return self.engine.detector(ServerVad(**settings.model_dump(exclude={"type"})))

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()


def install_realtime(app: FastAPI, engine: EngineClient, model_name: str, deploy: DeployConfig,
                     voices: Sequence[str], transcripts: TranscriptStore, media: MediaPolicy,
                     metrics: ServerMetrics) -> Vad:
    """The /v1/realtime route; returns the Vad to close at shutdown. `media`: the server's media policy
    (user images; the input audio buffer's bound is its max_audio_seconds)."""
    vad = Vad()
    ctx = SessionContext(engine, model_name, deploy, voices, transcripts, vad.detector,
                         int(media.max_audio_seconds * SAMPLE_RATE) * 2, metrics, media)

    @app.websocket("/v1/realtime")
    async def realtime(ws: WebSocket, model: str | None = None) -> None:
        await ws.accept()
        if model not in (None, model_name):
            error = RealtimeError(f"The model `{model}` does not exist.", "model", "model_not_found")
            await ws.send_text(json.dumps(error_event(error)))
            return await ws.close(POLICY_VIOLATION)
        await serve_session(ws, ctx)

    return vad


async def serve_session(ws: WebSocket, ctx: SessionContext) -> None:
    queue: asyncio.Queue[dict] = asyncio.Queue(SEND_QUEUE)
    session = RealtimeSession(ctx, queue.put)
    sender = asyncio.create_task(_send_all(ws, queue, session))
    try:
        await session.start()
        while True:
            message = await ws.receive()
            if message["type"] == "websocket.disconnect":
                break
            await session.handle(message.get("text") or message.get("bytes") or b"")
    finally:
        await session.close()
        sender.cancel()


async def _send_all(ws: WebSocket, queue: asyncio.Queue[dict], session: RealtimeSession) -> None:
    try:
        while True:
            await ws.send_text(json.dumps(await queue.get(), separators=(",", ":")))
    except Exception:  # NOTE: the socket went away; the receive loop sees the disconnect and ends the session
        logger.debug("realtime socket closed while sending", exc_info=True)
        session.closed = True
        while not queue.empty():  # lets go of emits waiting for room
            queue.get_nowait()
