"""Server VAD: silero-vad on every session's incoming audio, batched across sessions in one worker thread.

Each session's `TurnDetector` resamples its 24 kHz pcm16 to 16 kHz and cuts it into silero's 512-sample
(32 ms) windows; the `VadEngine` keeps every detector's recurrent state and runs, at most once per window
period, one model call on the oldest pending window of every detector that has one (N sessions: one call per
32 ms, not N). The event loop only awaits futures. Turns follow OpenAI's server_vad with silero's hysteresis.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from omnistage.server.realtime.resample import StreamResampler

logger = logging.getLogger(__name__)
RATE = 16000
WINDOW = 512  # samples at 16 kHz: 32 ms
CONTEXT = 64  # samples of the previous window silero prepends
STATE_SHAPE = (2, 128)  # silero's LSTM (h, c) per stream
# NOTE: a call waits for every stream fed in the last ACTIVE_S (sessions streaming in real time) to have a
# window, but no window waits longer than MAX_WAIT_S: N real-time sessions cost ~1 call per 32 ms, and a lone
# one (or sessions sending faster than real time) waits not at all.
MAX_WAIT_S = WINDOW / RATE
ACTIVE_S = 0.25  # longer than a client's usual append (20-200 ms), so sessions in real time count as fed lately
NEG_THRESHOLD_GAP = 0.15  # silero's VADIterator / get_speech_timestamps: below threshold - 0.15 is silence


@dataclass
class ServerVad:
    """A session's `turn_detection` settings (OpenAI `server_vad`)."""

    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    create_response: bool = True
    interrupt_response: bool = True


@dataclass
class TurnEvent:
    type: str  # "speech_started" | "speech_stopped"
    audio_ms: int  # from the start of all audio fed to the detector (OpenAI's audio_start_ms / audio_end_ms)


@dataclass(eq=False)
class _Job:
    windows: list[np.ndarray]
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    submitted: float = field(default_factory=time.monotonic)
    probs: list[float] = field(default_factory=list)


@dataclass(eq=False)  # NOTE: hashed by identity (the engine keys its pending set by stream)
class _Stream:
    """One detector's model state; touched by the worker thread only (under the engine's lock)."""

    jobs: deque[_Job] = field(default_factory=deque)
    context: torch.Tensor = field(default_factory=lambda: torch.zeros(CONTEXT))
    state: torch.Tensor = field(default_factory=lambda: torch.zeros(STATE_SHAPE))


def _resolve(job: _Job, probs: list[float] | BaseException) -> None:
    """Hand a job's probabilities (or the worker's failure) to its feed, on the feed's event loop."""
    def done() -> None:
        if job.future.done():  # NOTE: the feeding task may have been cancelled meanwhile
            return
        if isinstance(probs, BaseException):
            job.future.set_exception(probs)
        else:
            job.future.set_result(probs)

    try:
        job.loop.call_soon_threadsafe(done)
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

    def submit(self, stream: _Stream, windows: list[np.ndarray]) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        job = _Job(windows, loop.create_future(), loop)
        with self._cond:
            if self._closed:
                raise RuntimeError("the VAD engine is closed")
            stream.jobs.append(job)
            self._pending.setdefault(stream)
            self._fed_at[stream] = job.submitted
            self._cond.notify()
        return job.future

    def drop(self, stream: _Stream) -> None:
        """Forget a stream's pending windows (their feeds see no probabilities) and its recurrent state."""
        with self._cond:
            for job in stream.jobs:
                _resolve(job, [])
            stream.jobs.clear()
            self._pending.pop(stream, None)
            stream.context, stream.state = torch.zeros(CONTEXT), torch.zeros(STATE_SHAPE)

    def _run(self) -> None:
        # NOTE: importing silero_vad calls torch.set_num_threads(1); with OpenMP that binds this thread only.
        torch.set_num_threads(1)
        from silero_vad import load_silero_vad

        model = load_silero_vad()._model  # the stateless core: (context + window, state) -> (prob, state)
        while self._gather():
            with self._cond:
                tick = {stream.jobs[0] for stream in self._pending}  # NOTE: later arrivals wait for the next tick
            try:
                while self._step(model, tick):
                    pass
            except Exception as e:  # NOTE: fail the feeds waiting now; the worker lives on for later ones
                logger.exception("server VAD step failed")
                self._resolve_pending(e)
        self._resolve_pending([])

    def _resolve_pending(self, result: list[float] | BaseException) -> None:
        with self._cond:
            for stream in self._pending:
                for job in stream.jobs:
                    _resolve(job, result)
                stream.jobs.clear()
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

    def _step(self, model: torch.jit.ScriptModule, tick: set[_Job]) -> bool:
        """One batched call on the next window of up to max_batch of the tick's jobs; False when they are done."""
        with self._cond:
            batch = [(s, s.jobs[0]) for s in self._pending if s.jobs[0] in tick][:self.max_batch]
            if not batch:
                return False
            x = torch.stack([torch.cat([s.context, torch.from_numpy(j.windows[len(j.probs)])])
                             for s, j in batch])
            state = torch.stack([s.state for s, _ in batch], dim=1)
        with torch.inference_mode():
            prob, state = model(x, state)
        with self._cond:
            outs = zip(batch, prob[:, 0].tolist(), x[:, -CONTEXT:], state.unbind(1))
            for (stream, job), p, ctx, st in outs:
                if not stream.jobs or stream.jobs[0] is not job:
                    continue  # dropped while the call ran
                stream.context, stream.state = ctx, st
                job.probs.append(p)
                if len(job.probs) == len(job.windows):
                    _resolve(job, job.probs)
                    stream.jobs.popleft()
                    if not stream.jobs:
                        del self._pending[stream]
        return True


class TurnDetector:
    """One per session: feed it the session's input audio; it reports where turns start and stop."""

    def __init__(self, engine: VadEngine, params: ServerVad) -> None:
        self.engine, self.params = engine, params
        self._stream = _Stream()
        self._resampler = StreamResampler()
        self._samples = np.zeros(0, dtype=np.float32)  # 16 kHz, not yet a whole window
        self._clock = 0  # 16 kHz samples before self._samples
        self._speaking = False
        self._silence_from: int | None = None  # where the current silence began, while speaking

    async def feed(self, pcm24k: np.ndarray) -> list[TurnEvent]:
        """int16 mono 24 kHz, any length. NOTE: one feed at a time per detector (the session awaits each)."""
        new = self._resampler.push(pcm24k.astype(np.float32) / 32768.0)
        self._samples = np.concatenate([self._samples, new])
        n = self._samples.size // WINDOW
        if not n:
            return []
        windows = [self._samples[i * WINDOW:(i + 1) * WINDOW] for i in range(n)]
        start = self._clock
        self._samples, self._clock = self._samples[n * WINDOW:], start + n * WINDOW
        probs = await self.engine.submit(self._stream, windows)
        return [e for i, p in enumerate(probs) if (e := self._turn(start + i * WINDOW, p)) is not None]

    def reset(self) -> None:
        """Forget the speech state: model state, a turn in progress, audio not yet scored. The clock runs
        on."""
        self.engine.drop(self._stream)
        self._samples, self._clock = self._samples[:0], self._clock + self._samples.size
        self._speaking, self._silence_from = False, None

    def _turn(self, start: int, prob: float) -> TurnEvent | None:
        """One window's probability (the window starts at 16 kHz sample `start`) through the turn state."""
        p = self.params
        if prob >= p.threshold:
            self._silence_from = None
            if not self._speaking:
                self._speaking = True
                return TurnEvent("speech_started", max(0, _ms(start) - p.prefix_padding_ms))
        elif self._speaking and prob < max(p.threshold - NEG_THRESHOLD_GAP, 0.01):
            if self._silence_from is None:
                self._silence_from = start
            if _ms(start + WINDOW - self._silence_from) >= p.silence_duration_ms:  # heard the whole silence
                end, self._speaking, self._silence_from = _ms(self._silence_from), False, None
                return TurnEvent("speech_stopped", end)
        return None


def _ms(samples: int) -> int:
    return samples * 1000 // RATE
