"""A session's audio on its way to server VAD (server/realtime/turn_feed.py): appends never wait for the VAD,
what arrives while it is busy goes in one piece, and the turns are those of the audio fed whole."""

from __future__ import annotations

import asyncio

import numpy as np
from test_realtime_vad import engine, spoken  # noqa: F401 (engine: the module's VadEngine fixture)

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
