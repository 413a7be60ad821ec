"""Running one request on the engine for an HTTP handler, shared by the chat and speech endpoints:
refusals as 400s, a full admission queue as a 429, a dead engine as a 503, client disconnects as aborts in
every stage, per-request times for the metrics."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Protocol, TypeVar

import anyio
import numpy as np
from starlette.requests import ClientDisconnect, Request

from omnistage.outputs import SAMPLE_RATE, OutputDelta
from omnistage.sampling_params import SamplingParams, TalkerSamplingParams
from omnistage.pipeline.faults import EngineDeadError, EngineOverloaded, NoReplicaError
from omnistage.server.errors import OpenAIError, bad_request, overloaded, public_message, unavailable
from omnistage.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)
T = TypeVar("T")


class EngineClient(Protocol):
    """What the server needs from the engine (AsyncOmni). `generate` raises ValueError (MediaError is
    one) before its first item for a request the engine refuses: bad media, unknown voice, bad
    sampling."""

    def generate(self, request_id: str, messages: list[dict], sampling: SamplingParams,
                 talker_sampling: TalkerSamplingParams | None, voice: str | None,
                 use_audio_in_video: bool, session: str | None = None) -> AsyncIterator[OutputDelta]: ...

    async def open_request(self, request_id: str, messages: list[dict], sampling: SamplingParams,
                           talker_sampling: TalkerSamplingParams | None, voice: str | None,
                           session: str | None = None) -> StreamingInput:
        """A request whose last user message ends with an audio still arriving (AsyncOmni.open_request);
        raises ValueError or EngineOverloaded (refused)."""

    async def abort(self, request_id: str) -> None: ...


class StreamingInput(Protocol):
    """An open request (AsyncOmni's StreamingPrompt): `append_audio` (16 kHz float, each awaited before the
    next; `prepare(clip)` where the turn may end), then `close(audio)`, its deltas as `generate`'s; `abort()`
    frees it."""

    request_id: str
    early_audio_rows: int  # rows of the audio's encoder windows the thinker got before close (kept, after it)
    prepared: bool  # close found the whole prompt sent by `prepare`

    async def append_audio(self, pcm16k: np.ndarray) -> None: ...

    async def prepare(self, audio: np.ndarray) -> None: ...

    def mark(self, phase: str) -> None: ...

    def close(self, audio: np.ndarray | None = None) -> AsyncIterator[OutputDelta]: ...

    async def abort(self) -> None: ...


class EngineFailed(OpenAIError):
    """The request failed in a stage while in flight (its stream finished with finish_reason "error"): a
    500 answered as any OpenAIError, so the connection stays usable (an unhandled error would close it)."""

    def __init__(self) -> None:
        super().__init__("The server had an error while processing your request.", 500, "server_error")


def check_finished(last: OutputDelta) -> None:
    if last.finish_reason == "error":
        logger.error("request %s failed in the engine (its stage logged why)", last.request_id)
        raise EngineFailed()


class RequestClock:
    """Per-request times (seconds since arrival) for the metrics."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.ttft: float | None = None
        self.ttfp: float | None = None
        self.last_audio: float | None = None
        self.samples = 0
        self.phases: dict[str, float] | None = None

    def saw(self, delta: OutputDelta) -> None:
        now = time.perf_counter() - self.start
        if delta.finished:
            self.phases = delta.phases
        if delta.text and self.ttft is None:
            self.ttft = now
        if delta.audio is not None and delta.audio.size:
            self.ttfp = now if self.ttfp is None else self.ttfp
            self.last_audio, self.samples = now, self.samples + delta.audio.size

    def report(self, metrics: ServerMetrics) -> None:
        metrics.observe_finished(time.perf_counter() - self.start, self.ttft, self.ttfp,
                                 self.samples / SAMPLE_RATE, self.last_audio, phases=self.phases)


async def start_request(engine: EngineClient, request_id: str, messages: list[dict], sampling: SamplingParams,
                        talker_sampling: TalkerSamplingParams | None, voice: str | None,
                        use_audio_in_video: bool = False, session: str | None = None
                        ) -> AsyncIterator[OutputDelta]:
    """The request's deltas once the engine has admitted it (see `admitted`); `session`: its conversation's
    id (a realtime session's, a chat request's `prompt_cache_key`), which keeps it on one thinker replica."""
    return await admitted(engine.generate(request_id, messages, sampling, talker_sampling, voice,
                                          use_audio_in_video, session=session))


async def admitted(deltas: AsyncIterator[OutputDelta]) -> AsyncIterator[OutputDelta]:
    """`deltas` once its first is in hand, so a refusal is still a 400 (a full admission a 429, a dead
    engine a 503) rather than a broken stream."""
    try:
        first = await anext(deltas)
    except StopAsyncIteration:
        first = None
    except ValueError as e:
        raise bad_request(public_message(str(e)), getattr(e, "param", None)) from None
    except EngineOverloaded as e:
        raise overloaded(str(e), e.retry_after) from None
    except NoReplicaError:
        raise unavailable("Every replica of a stage is being started again; try again shortly.") from None
    except EngineDeadError:
        raise unavailable("The engine has failed and cannot take requests; see the server's log.") from None
    return _prepend(first, deltas)


async def _prepend(first: OutputDelta | None, rest: AsyncIterator[OutputDelta]) -> AsyncIterator[OutputDelta]:
    try:
        if first is not None:
            yield first
            async for delta in rest:
                yield delta
    finally:
        await rest.aclose()


async def collect(deltas: AsyncIterator[OutputDelta], engine: EngineClient, request_id: str,
                  clock: RequestClock) -> tuple[str, np.ndarray, OutputDelta]:
    """The whole answer: text, float32 audio (empty when none) and the last (finishing) delta."""
    text, audio, last = [], [], OutputDelta(request_id)
    try:
        async for last in deltas:
            clock.saw(last)
            text.append(last.text)
            if last.audio is not None:
                audio.append(last.audio)
    finally:
        await abort_unfinished(engine, last)
    check_finished(last)
    return "".join(text), np.concatenate(audio) if audio else np.zeros(0, np.float32), last


async def abort_unfinished(engine: EngineClient, last: OutputDelta) -> None:
    if not last.finished:
        logger.info("request %s stopped before it finished (client gone or error): aborting it",
                    last.request_id)
        # NOTE: shielded, or a client disconnect (a cancelled scope) would cancel the abort too.
        with anyio.CancelScope(shield=True):
            await engine.abort(last.request_id)


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """`work`, cancelled when the client goes away first (then ClientDisconnect). Starlette notices a
    disconnect only while it streams a body, so handlers that wait for the engine watch for it here."""
    host = asyncio.current_task()

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        host.cancel()

    watcher = asyncio.create_task(watch())
    try:
        return await work
    except asyncio.CancelledError:
        if watcher.done() and not watcher.cancelled():
            raise ClientDisconnect() from None
        raise
    finally:
        watcher.cancel()
