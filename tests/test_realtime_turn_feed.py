"""A session's audio on its way to server VAD (server/realtime/turn_feed.py): appends never wait for the VAD,
what arrives while it is busy goes in one piece, and the turns are those of the audio fed whole."""

from __future__ import annotations

import asyncio
import base64
import gc
import json
import weakref

import numpy as np
from test_realtime_vad import engine, spoken  # noqa: F401 (engine: the module's VadEngine fixture)

from omnistage.config import DEPLOY_DIR
from omnistage.config_loader import load_deploy_config
from omnistage.media import MediaPolicy
from omnistage.server.metrics import ServerMetrics
from omnistage.server.realtime.session import RealtimeSession, SessionContext
from omnistage.server.realtime.transcripts import TranscriptStore
from omnistage.server.realtime.turn_feed import TurnFeed
from omnistage.server.realtime.turns import OURS
from omnistage.server.realtime.vad import ServerVad, TurnEvent

APPEND = 480  # 20 ms at 24 kHz, a client's usual append


class Counting:
    """A TurnDetector that counts its calls (and fails the ones asked to)."""

    def __init__(self, detector, fail: set[int] = frozenset()) -> None:
        self.detector, self.fail, self.sizes = detector, fail, []

    async def feed(self, pcm: np.ndarray) -> list[TurnEvent]:
        self.sizes.append(pcm.size)
        if len(self.sizes) in self.fail:
            raise RuntimeError("boom")
        return await self.detector.feed(pcm)


async def through_feed(detector, pcm: np.ndarray, yield_every: int = 0) -> list[tuple[list[TurnEvent], int]]:
    """Pushes `pcm` in 20 ms appends (yielding to the loop every `yield_every`; 0: never), then drains."""
    calls = []

    async def on_fed(turns: list[TurnEvent], fed: int) -> None:
        calls.append((turns, fed))

    feed = TurnFeed(detector, on_fed)
    for i, k in enumerate(range(0, pcm.size, APPEND)):
        feed.push(pcm[k:k + APPEND])
        if yield_every and i % yield_every == 0:
            await asyncio.sleep(0)
    await feed.drain()
    return calls


def test_appends_while_the_vad_is_busy_go_in_one_piece(engine):
    pcm = spoken(0.3, "question_2s", 1.0)
    whole = asyncio.run(engine.detector(ServerVad()).feed(pcm))
    assert [e.type for e in whole if e.type not in OURS] == ["speech_started", "speech_stopped"]
    counting = Counting(engine.detector(ServerVad()))
    calls = asyncio.run(through_feed(counting, pcm))
    appends = -(-pcm.size // APPEND)
    assert len(counting.sizes) == 1 < appends  # all appended before the feed's task first ran: one piece
    assert sum(counting.sizes) == pcm.size and [fed for _, fed in calls] == list(np.cumsum(counting.sizes))
    assert [e for turns, _ in calls for e in turns] == whole


def test_turns_do_not_depend_on_how_appends_were_grouped(engine):
    pcm = spoken(0.5, "question_2s", 0.8, "question_2s", 1.0)
    whole = asyncio.run(engine.detector(ServerVad()).feed(pcm))
    counting = Counting(engine.detector(ServerVad()))
    calls = asyncio.run(through_feed(counting, pcm, yield_every=7))
    assert 2 < len(counting.sizes) < -(-pcm.size // APPEND) and calls[-1][1] == pcm.size
    assert [e for turns, _ in calls for e in turns] == whole
    assert [e.type for e in whole].count("speech_stopped") == 2


def test_a_failed_vad_call_loses_its_audio_only(engine):
    counting = Counting(engine.detector(ServerVad()), fail={1})
    pcm = spoken(0.3, "question_2s", 1.0)
    calls = asyncio.run(through_feed(counting, pcm, yield_every=5))
    assert len(counting.sizes) > 2 and calls[0] == ([], counting.sizes[0])
    assert calls[-1][1] == pcm.size  # the feed lived on
    assert [e.type for turns, _ in calls for e in turns if e.type not in OURS] == [
        "speech_started", "speech_stopped"]


def test_a_closed_session_is_freed_without_the_garbage_collector(engine) -> None:  # noqa: F811
    """Its feed, player and transcriber held its methods: a cycle kept its history and audio for a collection."""
    ctx = SessionContext(None, "m", load_deploy_config(DEPLOY_DIR / "qwen3_omni_moe.yaml", "cpu"), ["Ethan"],
                         TranscriptStore(), lambda td: engine.detector(ServerVad(**td.model_dump(exclude={"type"}))),
                         1 << 22, ServerMetrics(), MediaPolicy())
    vad = {"type": "server_vad", "silence_duration_ms": 300, "create_response": False}
    audio = base64.b64encode(spoken(0.3, "question_2s", 0.8).tobytes()).decode()
    sent: list[dict] = []

    async def session_events() -> weakref.ref:
        async def send(event: dict) -> None:
            sent.append(event)
        session = RealtimeSession(ctx, send)
        await session.start()
        for event in ({"type": "session.update", "session": {"type": "realtime", "audio": {"input": {
                "turn_detection": vad}}}}, {"type": "input_audio_buffer.append", "audio": audio},
                {"type": "conversation.item.create", "item": {"type": "message", "role": "user",
                                                               "content": [{"type": "input_text", "text": "Hi"}]}}):
            await session.handle(json.dumps(event))
        await session.close()
        return weakref.ref(session)

    gc.collect()
    gc.disable()
    try:
        ref = asyncio.run(session_events())
        assert ref() is None
    finally:
        gc.enable()
    assert [e["type"] for e in sent] == ["session.created", "session.updated", *(
        f"input_audio_buffer.speech_{x}" for x in ("started", "stopped")), "input_audio_buffer.committed",
        *["conversation.item.added", "conversation.item.done"] * 2]  # the spoken turn, then the text item
