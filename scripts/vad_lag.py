"""Server VAD beside busy Python threads: 32 sessions append 20 ms of speech every 20 ms for S seconds while
K threads run Python DUTY of the time (stand-ins for the stage workers); prints how long after the last append
the VAD had scored everything, appends awaited one by one ("await") or through `TurnFeed` ("feed").

    python scripts/vad_lag.py feed 3 10 0.6    # mode, K, S, DUTY

A 1 ms switch interval: a sitecustomize.py with sys.setswitchinterval(0.001) on PYTHONPATH.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time

import numpy as np

from omnistage.bench.speech import speech_clip
from omnistage.server.realtime.turn_feed import TurnFeed
from omnistage.server.realtime.turns import ServerVad
from omnistage.server.realtime.vad import VadEngine

APPEND = 480  # 20 ms at 24 kHz


def busy(duty: float, stop: threading.Event, steps=None) -> None:
    """A stage thread's stand-in: steps of 10 ms, DUTY of each running Python (then a wait without the GIL).
    With `steps` (an mp.Value) each step's Python is a fixed amount of work (its time alone), so a step that
    waits for the GIL takes longer; the steps are counted there."""
    work = _calibrate(0.01 * duty) if steps is not None else 0
    while not stop.is_set():
        t = time.perf_counter()
        if work:
            for _ in range(work):
                pass
        else:
            while time.perf_counter() - t < 0.01 * duty:
                pass
        if duty < 1:
            time.sleep(0.01 * (1 - duty))
        if steps is not None:
            with steps.get_lock():
                steps.value += 1


def _calibrate(seconds: float) -> int:
    """Empty loop iterations that take `seconds` here (the best of 5 runs of 100 000)."""
    best = min(_timed(100_000) for _ in range(5))
    return int(100_000 * seconds / best)


def _timed(n: int) -> float:
    t = time.perf_counter()
    for _ in range(n):
        pass
    return time.perf_counter() - t


async def session(engine: VadEngine, pcm: np.ndarray, mode: str) -> float:
    detector = engine.detector(ServerVad())

    async def on_fed(turns: list, fed: int) -> None:
        pass

    feed = TurnFeed(detector, on_fed)
    t0 = time.perf_counter()
    for i, k in enumerate(range(0, pcm.size, APPEND)):
        if mode == "await":
            await detector.feed(pcm[k:k + APPEND])
        else:
            feed.push(pcm[k:k + APPEND])
        await asyncio.sleep(max(0.0, t0 + (i + 1) * APPEND / 24000 - time.perf_counter()))
    await feed.drain()
    return time.perf_counter() - (t0 + pcm.size / 24000)


async def main(mode: str, seconds: float, sessions: int = 32) -> list[float]:
    engine = VadEngine()
    pcm = np.tile(speech_clip("question_2s"), int(seconds) // 2 + 1)[:int(seconds * 24000)]
    try:
        return await asyncio.gather(*(session(engine, pcm, mode) for _ in range(sessions)))
    finally:
        engine.close()


if __name__ == "__main__":
    mode, k, s, duty = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
    stop = threading.Event()
    threads = [threading.Thread(target=busy, args=(duty, stop)) for _ in range(k)]
    for t in threads:
        t.start()
    try:
        lags = asyncio.run(main(mode, s))
    finally:
        stop.set()
    interval = sys.getswitchinterval() * 1e3
    print(f"{mode}, {k} threads at {duty:.0%}, switch interval {interval:g} ms, {s:g} s: "
          f"lag after the last append mean {np.mean(lags) * 1e3:.0f} ms, max {np.max(lags) * 1e3:.0f} ms")
