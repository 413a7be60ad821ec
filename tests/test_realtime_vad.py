"""Server VAD (server/realtime/vad.py): streaming resampling, batched silero calls, OpenAI server_vad turns."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from scipy.signal import resample_poly

from omnistage.bench.speech import speech_clip
from omnistage.server.realtime.resample import StreamResampler
from omnistage.server.realtime.silero import MAX_WINDOWS
from omnistage.server.realtime.turns import OURS
from omnistage.server.realtime.vad import ServerVad, TurnEvent, VadEngine, _Stream

silero_vad = pytest.importorskip("silero_vad")


def pieces(x: np.ndarray, seed: int, lo: int = 1, hi: int = 1200) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    cuts = np.cumsum(rng.integers(lo, hi, size=x.size))
    return np.split(x, cuts[cuts < x.size])


def spoken(*parts: str | float) -> np.ndarray:
    """24 kHz pcm16: clips by name, silences in seconds."""
    return np.concatenate([np.zeros(int(p * 24000), np.int16) if isinstance(p, float) else speech_clip(p)
                           for p in parts])


def to_16k(pcm24: np.ndarray) -> np.ndarray:
    return StreamResampler().push(pcm24.astype(np.float32) / 32768.0)


@pytest.fixture(scope="module")
def engine():
    eng = VadEngine()
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def silero_model():
    return silero_vad.load_silero_vad()


def test_resampler_pieces_equal_whole_and_resample_poly():
    x = np.random.default_rng(0).standard_normal(24007).astype(np.float32)
    whole = StreamResampler().push(x)
    for seed in range(3):
        r = StreamResampler()
        assert np.array_equal(np.concatenate([r.push(p) for p in pieces(x, seed)]), whole)
    ref = resample_poly(x.astype(np.float64), 2, 3)
    assert ref.size == 16005 and whole.size == 15995  # the last outputs wait for input their filter reaches
    np.testing.assert_allclose(whole, ref[:whole.size], atol=1e-6)


def run(coro):
    return asyncio.run(coro)


def test_batched_equals_sequential_silero(engine, silero_model, monkeypatch):
    """Three sessions' windows in shared calls give silero's own stateful per-session probabilities."""
    clips = [spoken(0.3, name, 0.5) for name in ("question_2s", "question_3s", "question_5s")]
    windows = [[w[i:i + 512] for i in range(0, w.size - 511, 512)] for w in map(to_16k, clips)]
    steps = []
    step = VadEngine._step
    monkeypatch.setattr(VadEngine, "_step", lambda self, m, tick: steps.append(len(self._pending)) or step(self, m, tick))

    async def submit(*streams_windows):
        with engine._cond:  # NOTE: all pending before the worker looks (on a loaded machine it began on the first)
            futures = [engine.submit(_Stream(), ws) for ws in streams_windows]
        return await asyncio.gather(*futures)

    batched = run(submit(*windows))
    calls = len(steps)
    [alone] = run(submit(windows[0]))
    for ws, probs in zip(windows, batched):
        silero_model.reset_states()
        ref = [silero_model(torch.from_numpy(w), 16000).item() for w in ws]
        np.testing.assert_allclose(probs, ref, atol=1e-4)  # NOTE: matmuls of another batch size round otherwise
        assert max(ref) > 0.9 and min(ref) < 0.1
        if ws is windows[0]:
            assert alone == ref  # batch 1: bit for bit
    # batched: one call scores up to MAX_WINDOWS windows of every session, not one of one
    assert calls <= -(-max(map(len, windows)) // MAX_WINDOWS) + 3 and max(steps) == 3, (calls, steps)


async def heard(det, pcm24: np.ndarray, seed: int, pauses: bool = False) -> list[TurnEvent]:
    """The turn events of `pcm24` fed in uneven pieces (`pauses`: with our own, speech_paused / resumed)."""
    events = [e for p in pieces(pcm24, seed, 480, 961) for e in await det.feed(p)]
    return events if pauses else [e for e in events if e.type not in OURS]


def feed_all(engine: VadEngine, pcm24: np.ndarray, params: ServerVad, seed: int, pauses: bool = False
             ) -> list[TurnEvent]:
    return run(heard(engine.detector(params), pcm24, seed, pauses))


def reference_turns(silero_model, wav16: np.ndarray, params: ServerVad) -> list[TurnEvent]:
    """silero's get_speech_timestamps with the same settings, as OpenAI events."""
    spans = silero_vad.get_speech_timestamps(torch.from_numpy(wav16), silero_model, threshold=params.threshold,
                                             min_silence_duration_ms=params.silence_duration_ms,
                                             speech_pad_ms=0, min_speech_duration_ms=0)
    return [e for s in spans
            for e in (TurnEvent("speech_started", max(0, s["start"] // 16 - params.prefix_padding_ms)),
                      TurnEvent("speech_stopped", s["end"] // 16))]


@pytest.mark.parametrize("name", ["question_2s", "question_5s", "question_20s"])
def test_turns_match_get_speech_timestamps(engine, silero_model, name):
    params = ServerVad()
    pcm24 = spoken(0.5, name, 1.0)
    events = feed_all(engine, pcm24, params, seed=1)
    assert [e.type for e in events] == ["speech_started", "speech_stopped"]
    assert events == reference_turns(silero_model, to_16k(pcm24), params)  # the same 16 kHz audio: exact
    clip16 = np.concatenate([np.zeros(8000, np.float32), speech_clip(name, 16000) / 32768.0,
                             np.zeros(16000, np.float32)])
    for ours, theirs in zip(events, reference_turns(silero_model, clip16.astype(np.float32), params)):
        assert abs(ours.audio_ms - theirs.audio_ms) <= 32  # the original 16 kHz clip: within a window


def test_two_turns_and_settings(engine):
    pcm24 = spoken(0.2, "question_2s", 0.8, "question_3s", 1.5)
    default = feed_all(engine, pcm24, ServerVad(), seed=2)
    assert [e.type for e in default] == ["speech_started", "speech_stopped"] * 2
    assert default[0].audio_ms == 0  # 200 ms of silence, less 300 ms of prefix padding: clamped
    assert feed_all(engine, pcm24, ServerVad(), seed=3) == default  # cut differently: the same turns
    long_pause = feed_all(engine, pcm24, ServerVad(silence_duration_ms=1200), seed=2)
    assert [e.type for e in long_pause] == ["speech_started", "speech_stopped"]  # the 0.8 s pause is inside
    assert long_pause[0] == default[0] and long_pause[1] == default[3]
    no_pad = feed_all(engine, pcm24, ServerVad(prefix_padding_ms=0), seed=2)
    assert (no_pad[1], no_pad[3]) == (default[1], default[3])
    assert no_pad[0].audio_ms >= 192 and no_pad[2].audio_ms == default[2].audio_ms + 300
    assert feed_all(engine, spoken(2.0), ServerVad(), seed=4) == []  # silence


def test_each_stop_follows_a_pause_at_its_end(engine):
    """speech_paused comes once per silence within a turn, after min(150, silence / 2) ms of it; the silence
    that ends the turn was reported as a pause at the very point the turn stops (what a prepared turn's clip
    ends at)."""
    for vad in (ServerVad(), ServerVad(silence_duration_ms=200)):
        events = feed_all(engine, spoken(0.3, "question_2s", 0.8, "question_3s", 1.0), vad, seed=9, pauses=True)
        stops = [i for i, e in enumerate(events) if e.type == "speech_stopped"]
        assert len(stops) == 2 and events[0].type == "speech_started"
        for i in stops:
            assert events[i - 1] == TurnEvent("speech_paused", events[i].audio_ms)
        assert feed_all(engine, spoken(0.3, "question_2s", 0.8, "question_3s", 1.0), vad, seed=9) == [
            e for e in events if e.type not in OURS]


def test_reset_drops_the_turn_in_progress(engine):
    async def go():
        det = engine.detector(ServerVad())
        first = await heard(det, spoken(0.5, "question_2s")[:36000], 5)
        det.reset()
        rest = await heard(det, spoken(0.6, "question_3s", 1.0), 6)
        return first, rest

    first, rest = run(go())
    assert [e.type for e in first] == ["speech_started"]
    assert [e.type for e in rest] == ["speech_started", "speech_stopped"]  # no stop for the dropped turn
    assert rest[0].audio_ms >= 1500 + 600 - 300 - 32  # the clock ran on through the reset


def test_idle_sessions_share_calls(engine, monkeypatch):
    """64 sessions streaming silence in 20 ms appends at real time: about one model call per 32 ms."""
    steps = []
    step = VadEngine._step
    monkeypatch.setattr(VadEngine, "_step", lambda self, m, tick: steps.append(len(self._pending)) or step(self, m, tick))
    chunk = np.zeros(480, np.int16)

    async def session(det):
        for _ in range(50):  # 1 s
            await asyncio.gather(det.feed(chunk), asyncio.sleep(0.02))

    async def go():
        await asyncio.gather(*[session(engine.detector(ServerVad())) for _ in range(64)])

    run(go())
    windows = 64 * (50 * 320 // 512)
    assert sum(steps) >= windows - 64 and len(steps) < windows / 8


def test_a_failed_call_fails_its_feeds_only(monkeypatch):
    eng = VadEngine()
    step, calls = VadEngine._step, []

    def failing_once(self, model, tick):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return step(self, model, tick)

    monkeypatch.setattr(VadEngine, "_step", failing_once)

    async def go():
        det = eng.detector(ServerVad())
        with pytest.raises(RuntimeError, match="boom"):
            await det.feed(spoken(0.1))
        return await heard(det, spoken(0.3, "question_2s", 1.0), 7)

    try:
        assert [e.type for e in run(go())] == ["speech_started", "speech_stopped"]
    finally:
        eng.close()
    with pytest.raises(RuntimeError, match="closed"):
        run(eng.detector(ServerVad()).feed(spoken(0.1)))



def test_reset_with_audio_the_worker_has_not_seen(engine):
    """A reset while a feed's audio waits for the worker: that audio still counts (the clock and the 16 kHz
    stream run on), as when the worker had scored it first."""
    async def rest(det):
        return await heard(det, spoken(0.3, "question_2s", 1.0), 8)

    async def reset_first():
        det = engine.detector(ServerVad())
        with engine._cond:  # NOTE: the worker cannot take the feed's job before the reset
            feed = asyncio.ensure_future(det.feed(spoken(0.5)))
            await asyncio.sleep(0)
            det.reset()
        assert await feed == []
        return await rest(det)

    async def scored_first():
        det = engine.detector(ServerVad())
        await det.feed(spoken(0.5))
        det.reset()
        return await rest(det)

    early, late = run(reset_first()), run(scored_first())
    assert [e.type for e in early] == ["speech_started", "speech_stopped"] and early == late
