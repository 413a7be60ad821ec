"""EarlyPrefill's hand-on of a spoken turn's audio (server/realtime/early_prefill.py), against a fake engine
whose append_audio blocks until released: a feed never waits for it, what arrives meanwhile goes on in one
piece, and close and abort wait for the append in flight (the stream takes one call at a time)."""

from __future__ import annotations

import asyncio

import numpy as np

from omnistage.config import DeployConfig
from omnistage.server.metrics import ServerMetrics
from omnistage.server.realtime.conversation import Conversation, pcm_to_16k
from omnistage.server.realtime.early_prefill import EarlyPrefill
from omnistage.server.realtime.input_buffer import InputAudioBuffer
from omnistage.server.realtime.settings import initial

VOICES = ["Ethan"]


class SlowStream:
    """A StreamingInput whose append_audio waits for `release`; records what it got and when it overlapped."""

    def __init__(self) -> None:
        self.request_id, self.early_audio_rows, self.prepared = "req", 0, False
        self.release = asyncio.Event()
        self.got: list[np.ndarray] = []
        self.busy = False
        self.overlapped = False
        self.calls: list[str] = []

    async def append_audio(self, pcm16k: np.ndarray) -> None:
        self.overlapped |= self.busy
        self.busy = True
        await self.release.wait()
        self.got.append(pcm16k)
        self.busy = False

    async def prepare(self, audio: np.ndarray) -> None:
        self.overlapped |= self.busy
        self.calls.append("prepare")
        self.clip = audio

    async def close(self, audio: np.ndarray):  # an async generator, as StreamingInput.close's deltas
        self.overlapped |= self.busy
        self.calls.append("close")
        yield object()

    async def abort(self) -> None:
        self.overlapped |= self.busy
        self.calls.append("abort")


class FakeEngine:
    def __init__(self) -> None:
        self.stream = SlowStream()

    async def open_request(self, *args, **kwargs) -> SlowStream:
        return self.stream


def pcm(ms: int, seed: int) -> bytes:
    return (np.random.default_rng(seed).normal(0, 3000, ms * 24)).astype("<i2").tobytes()


async def opened(preemptive: bool = False) -> tuple[EarlyPrefill, FakeEngine, InputAudioBuffer]:
    """Not `preemptive` (the default's opposite): a pause prepares its clip and the audio after it goes on."""
    engine = FakeEngine()
    deploy = DeployConfig(realtime_streaming_input=True, realtime_preemptive_response=preemptive)
    early = EarlyPrefill(engine, VOICES, deploy, ServerMetrics())
    buffer = InputAudioBuffer(1 << 24)
    buffer.append(pcm(40, 0))
    await early.open(initial(VOICES, "m"), Conversation(), "item_1", buffer)
    await asyncio.sleep(0)  # the open's audio goes on: its append is in flight
    return early, engine, buffer


async def paused(early: EarlyPrefill, engine: FakeEngine, buffer: InputAudioBuffer) -> tuple[int, np.ndarray]:
    """60 ms more fed while the open's append is in flight, a pause 30 ms before their end prepared, then the
    append released: (the pause's end, its clip)."""
    buffer.append(pcm(60, 1))
    early.feed(buffer)
    end = buffer.end - 24 * 30
    early.prepare(buffer, end)
    engine.stream.release.set()
    return end, await early.clip(end)


def test_feeds_never_wait_and_what_arrives_meanwhile_goes_on_in_one_piece():
    async def main():
        early, engine, buffer = await opened()
        for seed in (1, 2, 3):  # the first append is in flight, blocked: these return at once
            buffer.append(pcm(20, seed))
            early.feed(buffer)
        engine.stream.release.set()
        async with asyncio.timeout(5):
            while engine.stream.busy or len(engine.stream.got) < 2:
                await asyncio.sleep(0.001)
        await early.abort()
        return engine.stream, buffer

    stream, buffer = asyncio.run(main())
    assert len(stream.got) == 2 and not stream.overlapped  # the open's 40 ms, then the three feeds together
    assert stream.calls == ["abort"]
    fed = np.concatenate(stream.got)
    whole = pcm_to_16k(bytes(buffer.pcm))
    assert whole.size - 10 <= fed.size < whole.size and np.array_equal(fed, whole[:fed.size])


def test_abort_waits_for_the_append_in_flight():
    async def main():
        early, engine, buffer = await opened()
        buffer.append(pcm(20, 1))
        early.feed(buffer)
        abort = asyncio.create_task(early.abort())
        await asyncio.sleep(0.01)
        assert engine.stream.calls == []  # held until the append returns
        engine.stream.release.set()
        await abort
        return engine.stream

    stream = asyncio.run(main())
    assert stream.calls == ["abort"] and not stream.overlapped and len(stream.got) == 1


def test_a_pause_is_prepared_before_the_audio_pending():
    """prepare(end) while an append is in flight and more audio waits: the clip up to `end` is resampled and
    prepared next (before that audio), and clip(end) is its pcm_to_16k bit for bit; another end has none; an
    abort leaves a pending clip's waiter with None."""
    async def main():
        early, engine, buffer = await opened()
        end, clip = await paused(early, engine, buffer)
        assert await early.clip(end + 1) is None
        async with asyncio.timeout(5):
            while "prepare" not in engine.stream.calls or engine.stream.busy:
                await asyncio.sleep(0.001)
        got = len(engine.stream.got)
        engine.stream.release.clear()
        early.prepare(buffer, end - 480)
        waiter = asyncio.create_task(early.clip(end - 480))
        await early.abort()
        return engine.stream, clip, bytes(buffer.pcm[:end * 2]), got, await waiter

    stream, clip, pcm16, got, aborted = asyncio.run(main())
    assert np.array_equal(clip, pcm_to_16k(pcm16)) and np.array_equal(stream.clip, clip)
    assert got == 2 and stream.calls[0] == "prepare"  # the open's 40 ms, the pause, then the 60 ms pending
    assert aborted is None and not stream.overlapped


def test_a_preemptive_pause_closes_the_request_on_its_clip():
    """Preemptive (the default): the pause's clip is prepared and the request closed with it; the audio pending
    after the pause and later feeds do not go on (the turn's response takes the close's deltas)."""
    async def main():
        early, engine, buffer = await opened(preemptive=True)
        end, clip = await paused(early, engine, buffer)
        async with asyncio.timeout(5):
            while "close" not in engine.stream.calls:
                await asyncio.sleep(0.001)
        buffer.append(pcm(20, 2))
        early.feed(buffer)
        await asyncio.sleep(0.01)
        return engine.stream, clip, bytes(buffer.pcm[:end * 2])

    stream, clip, pcm16 = asyncio.run(main())
    assert stream.calls == ["prepare", "close"] and len(stream.got) == 1  # the open's 40 ms only
    assert np.array_equal(clip, pcm_to_16k(pcm16)) and np.array_equal(stream.clip, clip)
