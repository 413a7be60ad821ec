"""Server VAD: silero-vad on every session's incoming audio, batched across sessions in one worker thread.

Each session's `TurnDetector` counts its 24 kHz pcm16 and hands it on once it completes a silero window
(512 samples at 16 kHz: 32 ms); the `VadEngine`'s worker resamples all streams' audio to 16 kHz in one call a
tick, cuts the windows, keeps every detector's recurrent state and runs, at most once per window period, one
model call on the pending windows of every detector that has some (N sessions: one call per 32 ms, not N;
a backlog over silero.MAX_WINDOWS takes more). The event loop only counts samples and awaits futures.
Turns: turns.py.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from omnistage.server.realtime.resample import Audio24k, WindowedStream, ready, windows_many
from omnistage.server.realtime.silero import CONTEXT, MAX_WINDOWS, STATE_SHAPE, WINDOW, Scorer, stack
from omnistage.server.realtime.turns import RATE, ServerVad, TurnEvent, TurnState

logger = logging.getLogger(__name__)
# NOTE: a call waits for every stream fed in the last ACTIVE_S (sessions streaming in real time) to have a
# window, but no window waits longer than MAX_WAIT_S: N real-time sessions cost ~1 call per 32 ms, and a lone
# one (or sessions sending faster than real time) waits not at all.
MAX_WAIT_S = WINDOW / RATE
ACTIVE_S = 0.25  # longer than a client's usual append (20-200 ms), so sessions in real time count as fed lately


@dataclass(eq=False)
class _Job:
    windows: list[np.ndarray]
    audio: Audio24k | None  # not yet resampled into `windows`
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    submitted: float = field(default_factory=time.monotonic)
    probs: list[float] = field(default_factory=list)


@dataclass(eq=False)  # NOTE: hashed by identity (the engine keys its pending set by stream)
class _Stream:
    """One detector's model state; touched by the worker thread only (under the engine's lock)."""

    jobs: deque[_Job] = field(default_factory=deque)
    context: np.ndarray = field(default_factory=lambda: np.zeros(CONTEXT, np.float32))
    state: np.ndarray = field(default_factory=lambda: np.zeros(STATE_SHAPE, np.float32))
    audio: WindowedStream = field(default_factory=WindowedStream)


def _resolve(jobs: list[_Job], result: list[float] | BaseException | None = None) -> None:
    """Hand jobs their probabilities (or `result`: the worker's failure, or nothing) on their feeds' event
    loops, one wakeup per loop."""
    def done(jobs: list[_Job]) -> None:
        for job in jobs:
            if job.future.done():  # NOTE: the feeding task may have been cancelled meanwhile
                continue
            probs = job.probs if result is None else result
            if isinstance(probs, BaseException):
                job.future.set_exception(probs)
            else:
                job.future.set_result(probs)

    by_loop: dict[asyncio.AbstractEventLoop, list[_Job]] = {}
    for job in jobs:
        by_loop.setdefault(job.loop, []).append(job)
    for loop, its in by_loop.items():
        try:
            loop.call_soon_threadsafe(done, its)
        except RuntimeError:  # NOTE: that loop is closed: nobody waits any more
            pass


class VadEngine:
    """One per server: all sessions' pending windows go through one batched silero call per tick."""

    def __init__(self, max_batch: int = 64) -> None:
        self.max_batch = max_batch
        self._cond = threading.Condition()
        self._pending: dict[_Stream, None] = {}  # streams with jobs, oldest first
        self._fed_at: dict[_Stream, float] = {}  # last submit of each stream fed lately
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="omnistage-vad", daemon=True)
        self._thread.start()

    def detector(self, params: ServerVad) -> TurnDetector:
        return TurnDetector(self, params)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()

    def submit(self, stream: _Stream, windows: list[np.ndarray] | Audio24k) -> asyncio.Future:
        """A future of the windows' probabilities: 16 kHz windows, or 24 kHz audio to cut them from."""
        loop = asyncio.get_running_loop()
        audio = windows if isinstance(windows, Audio24k) else None
        job = _Job([] if audio else windows, audio, loop.create_future(), loop)
        with self._cond:
            if self._closed:
                raise RuntimeError("the VAD engine is closed")
            idle = not self._pending
            stream.jobs.append(job)
            self._pending.setdefault(stream)
            self._fed_at[stream] = job.submitted
            if idle or len(self._pending) >= len(self._fed_at):  # NOTE: else the worker's wait times out
                self._cond.notify()
        return job.future

    def drop(self, stream: _Stream) -> None:
        """Forget a stream's pending windows (their feeds see no probabilities) and its recurrent state."""
        with self._cond:
            self._clear(stream, [])
            self._pending.pop(stream, None)
            stream.context, stream.state = np.zeros(CONTEXT, np.float32), np.zeros(STATE_SHAPE, np.float32)

    def _clear(self, stream: _Stream, result: list[float] | BaseException) -> None:
        """Resolve a stream's jobs with `result`; their audio still goes through its resampler."""
        for job in stream.jobs:
            self._resample([(stream, job)])
        _resolve(list(stream.jobs), result)
        stream.jobs.clear()

    @staticmethod
    def _resample(jobs: list[tuple[_Stream, _Job]]) -> None:
        """Cut the windows of jobs that bring 24 kHz audio (one job a stream), all streams in one call."""
        todo = [(s, j) for s, j in jobs if j.audio is not None]
        for (_, job), windows in zip(todo, windows_many([(s.audio, j.audio) for s, j in todo], WINDOW)):
            job.windows, job.audio = windows, None

    def _run(self) -> None:
        scorer = Scorer()
        while self._gather():
            try:
                with self._cond:
                    heads = [(stream, stream.jobs[0]) for stream in self._pending]
                    self._resample(heads)
                tick = {job for _, job in heads}  # NOTE: later arrivals wait for the next tick
                while self._step(scorer, tick):
                    pass
            except Exception as e:  # NOTE: fail the feeds waiting now; the worker lives on for later ones
                logger.exception("server VAD step failed")
                self._resolve_pending(e)
        self._resolve_pending([])

    def _resolve_pending(self, result: list[float] | BaseException) -> None:
        with self._cond:
            for stream in self._pending:
                self._clear(stream, result)
            self._pending.clear()

    def _gather(self) -> bool:
        """Wait until every stream fed lately has a window pending, or the oldest has waited MAX_WAIT_S.

        False once closed."""
        with self._cond:
            while not self._closed:
                now = time.monotonic()
                self._fed_at = {s: t for s, t in self._fed_at.items() if now - t < ACTIVE_S}
                if self._pending:
                    waited = now - next(iter(self._pending)).jobs[0].submitted
                    if len(self._pending) >= len(self._fed_at) or waited >= MAX_WAIT_S:
                        return True
                    self._cond.wait(MAX_WAIT_S - waited)
                else:
                    self._cond.wait()
            return False

    def _step(self, scorer: Scorer, tick: set[_Job]) -> bool:
        """One call on the next windows of up to max_batch of the tick's jobs; False when they are done."""
        with self._cond:
            batch = [(s, s.jobs[0]) for s in self._pending if s.jobs[0] in tick][:self.max_batch]
            if not batch:
                return False
            batch.sort(key=lambda sj: len(sj[1].probs) - len(sj[1].windows))  # most windows left first
            rows = stack([(s.context, s.state, j.windows[len(j.probs):len(j.probs) + MAX_WINDOWS])
                          for s, j in batch])
        probs, state = scorer(rows)
        with self._cond:
            done = []
            for b, ((stream, job), n) in enumerate(zip(batch, rows.counts)):
                if not stream.jobs or stream.jobs[0] is not job:
                    continue  # dropped while the call ran
                stream.context, stream.state = rows.context(b).copy(), state[:, b]
                job.probs.extend(probs[:n, b].tolist())
                if len(job.probs) == len(job.windows):
                    done.append(stream.jobs.popleft())
                    if not stream.jobs:
                        del self._pending[stream]
            _resolve(done)
        return True


class TurnDetector:
    """One per session: feed it the session's input audio; it reports where turns start and stop."""

    def __init__(self, engine: VadEngine, params: ServerVad) -> None:
        self.engine, self.params = engine, params
        self._stream = _Stream()
        self._pcm: list[np.ndarray] = []  # 24 kHz, not yet handed on
        self._fed = 0  # 24 kHz samples fed
        self._clock = 0  # 16 kHz: where the next window starts
        self._turns = TurnState(params)

    async def feed(self, pcm24k: np.ndarray) -> list[TurnEvent]:
        """int16 mono 24 kHz, any length (kept, not copied, until it completes a window). NOTE: one feed at
        a time per detector (the session awaits each)."""
        self._pcm.append(pcm24k)
        self._fed += pcm24k.size
        n = (ready(self._fed) - self._clock) // WINDOW
        if n <= 0:
            return []
        start, self._clock = self._clock, self._clock + n * WINDOW
        audio, self._pcm = Audio24k(np.concatenate(self._pcm), start, n), []
        ends = range(start + WINDOW, self._clock + 1, WINDOW)
        probs = await self.engine.submit(self._stream, audio)
        return [e for end, p in zip(ends, probs) if (e := self._turns.step(end - WINDOW, end, p)) is not None]

    def reset(self) -> None:
        """Forget the speech state: model state, a turn in progress, audio not yet scored. The clock runs
        on."""
        self.engine.drop(self._stream)
        self._clock = ready(self._fed)
        self._turns = TurnState(self.params)
