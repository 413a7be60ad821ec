"""Streaming input for a spoken turn (server VAD; deploy `realtime_streaming_input`): at speech start the
turn's request is opened (`EngineClient.open_request`) with the prompt the committed turn will have (its
growing audio the last content part), and the turn's audio goes to it as it is appended (24 -> 16 kHz by
`StreamResampler`, bit-equal to the committed clip's `pcm_to_16k`), so the thinker encodes and prefills the
turn's complete encoder windows while the user speaks: end of turn -> first audio does not grow with the
turn. The turn's response takes the open request when its prompt, sampling and voice are still those it was
opened with, and closes it with the exact clip (the engine checks what it got against it); otherwise the
request is aborted and the response takes the ordinary path. The audio goes to the request from a task of
its own (what arrived meanwhile in one piece), so the session's appends, and with them its VAD, never wait
for the feature extraction. Where the user pauses (`speech_paused`, before the VAD's silence is complete) the
turn's clip should it end there is resampled and its whole prompt made and sent to be prefilled: a turn that
does end there then costs the thinker one row at close (`PromptStream.prepare`). With deploy
`realtime_preemptive_response` the request is closed there and then with that clip (`Preempted`): the response
that takes it gets its deltas, held so far; should the user speak on, it is dropped and the turn's request opened
again with all its audio (`resume`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from omnistage.config import DeployConfig
from omnistage.outputs import OutputDelta
from omnistage.pipeline.faults import EngineDeadError, EngineOverloaded
from omnistage.sampling_params import SamplingParams, TalkerSamplingParams
from omnistage.server.realtime.conversation import Conversation, Item, Part, pcm_float, pcm_to_16k
from omnistage.server.realtime.events import RealtimeError, ResponseParams
from omnistage.server.metrics import ServerMetrics
from omnistage.server.realtime.input_buffer import InputAudioBuffer
from omnistage.server.realtime.resample import StreamResampler
from omnistage.server.realtime.response import Response, new_response
from omnistage.server.realtime.settings import SessionSettings
from omnistage.server.serving import EngineClient, StreamingInput, admitted

logger = logging.getLogger(__name__)
RequestKey = tuple[list[dict], SamplingParams, TalkerSamplingParams | None, str]


@dataclass
class Preempted:
    """The open request closed where the user paused, on `clip`; `deltas`: `admitted(close(clip))`."""

    clip: np.ndarray
    deltas: asyncio.Task

    def drop(self) -> None:
        self.deltas.cancel()
        if self.deltas.done() and not self.deltas.cancelled():
            self.deltas.exception()  # NOTE: retrieved: a refusal nobody awaits is not logged as lost


class EarlyPrefill:
    """A session's open request for the turn being spoken (at most one)."""

    def __init__(self, engine: EngineClient, voices: Sequence[str], deploy: DeployConfig,
                 metrics: ServerMetrics, session: str | None = None) -> None:
        self.engine, self.voices, self.deploy, self.metrics = engine, voices, deploy, metrics
        self.session = session  # the realtime session's id (its requests' thinker replica)
        self._open: StreamingInput | None = None
        self._key: RequestKey | None = None
        self._taken: StreamingInput | None = None  # taken by a response whose task has not closed it yet
        self._resampler = StreamResampler()  # the open request's
        self._fed = 0  # the session sample up to which the input audio went to it
        self._pending: list[bytes] = []  # input audio not yet handed to the open request
        self._pump: asyncio.Task | None = None  # hands `_pending` on; at most one call at a time
        self._ahead: tuple[int, bytes] | None = None  # a pause's end and clip, for the pump (before `_pending`)
        self._clip: tuple[int, asyncio.Future] | None = None  # that clip at 16 kHz, once resampled
        self._preempted: Preempted | None = None  # the open request, closed at that pause

    async def open(self, settings: SessionSettings, conversation: Conversation, item_id: str,
                   buffer: InputAudioBuffer) -> None:
        """Opens the request of the turn `item_id` (its audio: `buffer`'s from `buffer.origin` on), as its
        server VAD response will be made; a turn the engine refuses now is left to the ordinary path."""
        await self.abort()
        if not self.deploy.realtime_streaming_input:
            return
        pending = Conversation()
        pending.items = [*conversation.items, Item(item_id, "user", [Part("input_audio", pcm=b"")])]
        try:
            response, *request = new_response(settings, ResponseParams(), pending, self.voices, self.deploy)
            key = _key(response, *request)
            self._open = await self.engine.open_request(response.id, *key, session=self.session)
        except (RealtimeError, ValueError, EngineOverloaded, EngineDeadError) as e:
            logger.debug("realtime turn %s not streamed: %s", item_id, e)
            return
        self._key, self._resampler, self._fed = key, StreamResampler(), buffer.origin
        self.feed(buffer)

    def feed(self, buffer: InputAudioBuffer) -> None:
        """The audio appended to `buffer` since the last feed goes to the open request (soon: not awaited)."""
        if self._open is None or self._preempted is not None or buffer.end <= self._fed:
            return
        self._pending.append(bytes(buffer.pcm[(self._fed - buffer.origin) * 2:]))
        self._fed = buffer.end
        self._run()

    def prepare(self, buffer: InputAudioBuffer, end: int) -> None:
        """The user paused at session sample `end`: the turn's clip should it end there, and its whole prompt
        (`StreamingInput.prepare`), are made now, before the audio still pending; `clip(end)` awaits the
        first."""
        if self._open is None or end <= buffer.origin:
            return
        self._ahead = end, bytes(buffer.pcm[:(end - buffer.origin) * 2])
        self._cancel_clip()
        self._clip = end, asyncio.get_running_loop().create_future()
        self._run()

    def turn_ended(self) -> None:
        """Server VAD ended the turn now (the open request's "turn_end" phase)."""
        if self._open is not None:
            self._open.mark("turn_end")

    async def clip(self, end: int) -> np.ndarray | None:
        """The 16 kHz clip `prepare(buffer, end)` made (None: no such one), as pcm_to_16k gives it."""
        if self._clip is None or self._clip[0] != end:
            return None
        future = self._clip[1]
        await asyncio.wait([future])
        return None if future.cancelled() else future.result()

    def _run(self) -> None:
        if self._pump is None or self._pump.done():
            self._pump = asyncio.create_task(self._hand_on(self._open))

    async def _hand_on(self, stream: StreamingInput) -> None:
        while (self._pending or self._ahead) and self._open is stream:
            try:
                if self._ahead is not None:
                    (end, pcm), self._ahead = self._ahead, None
                    audio = await asyncio.to_thread(pcm_to_16k, pcm)
                    if self._clip is not None and self._clip[0] == end and not self._clip[1].done():
                        self._clip[1].set_result(audio)
                    await stream.prepare(audio)
                    if self._preempts(stream, end):
                        self._pending, self._preempted = [], Preempted(audio, asyncio.create_task(
                            admitted(stream.close(audio))))
                        return
                else:
                    pcm, self._pending = b"".join(self._pending), []
                    await stream.append_audio(self._resampler.push(pcm_float(pcm)))
            except Exception:
                logger.exception("streaming a realtime turn's audio failed; it takes the ordinary path")
                await self.abort()

    def _cancel_clip(self) -> None:
        if self._clip is not None:
            self._clip[1].cancel()
            self._clip = None

    async def _settled(self) -> None:
        """After the call in flight, if any: the stream takes one call at a time."""
        self._pending, self._ahead = [], None
        self._cancel_clip()
        if self._pump is not None and self._pump is not asyncio.current_task():
            await asyncio.wait([self._pump])

    async def take(self, response: Response, messages: list[dict], sampling: SamplingParams,
                   talker: TalkerSamplingParams | None) -> StreamingInput | None:
        """The open request, when `response` (new_response's) is the one it was opened for (and, closed where
        the user paused, on its clip); the response then takes its id (the engine's request id)."""
        if self._open is None or not _same(_key(response, messages, sampling, talker), self._key):
            return None
        if self._preempted is not None and not _same(self._preempted.clip, messages[-1]["content"][-1]["audio"]):
            await self.abort()
            return None
        self._taken, self._open = self._open, None
        response.id = self._taken.request_id
        return self._taken

    async def close(self, stream: StreamingInput, messages: list[dict]) -> AsyncIterator[OutputDelta]:
        """A taken request's deltas once admitted (as `start_request`'s), closed with the committed clip."""
        self._taken = None
        await self._settled()
        if self._preempted is not None:
            preempted, self._preempted = self._preempted, None
            self.metrics.realtime_preempted.inc(outcome="used")
            deltas = await preempted.deltas
        else:
            deltas = await admitted(stream.close(messages[-1]["content"][-1]["audio"]))
        self.metrics.realtime_streamed_rows.inc(stream.early_audio_rows)
        self.metrics.realtime_prepared_turns.inc(stream.prepared)
        return deltas

    async def abort(self) -> None:
        """Frees the open request: its turn ended without a response for it, or its prompt went stale."""
        if self._open is not None:
            stream, self._open = self._open, None
            await self._settled()
            self._drop_preempted()
            await stream.abort()

    async def resume(self, settings: SessionSettings, conversation: Conversation, item_id: str,
                     buffer: InputAudioBuffer) -> None:
        """The user spoke on after a pause: its clip is not the turn's; a response started there is dropped, and
        the turn's request opened again with all its audio so far."""
        self._ahead = None
        self._cancel_clip()
        if self._preempted is not None:
            await self.open(settings, conversation, item_id, buffer)

    def _preempts(self, stream: StreamingInput, end: int) -> bool:
        """The request is to be closed at the pause at `end` now: the user has not spoken on since."""
        return (self.deploy.realtime_preemptive_response and self._open is stream and self._clip is not None
                and self._clip[0] == end)

    def _drop_preempted(self) -> None:
        if self._preempted is not None:
            self._preempted.drop()
            self._preempted = None
            self.metrics.realtime_preempted.inc(outcome="dropped")

    async def cancelled(self) -> None:
        """The playing response was cancelled: if that was before its task ran, the request it took was
        never closed (nor aborted by the task)."""
        if self._taken is not None:
            stream, self._taken = self._taken, None
            await self._settled()
            self._drop_preempted()
            await stream.abort()


def _key(response: Response, messages: list[dict], sampling: SamplingParams,
         talker: TalkerSamplingParams | None) -> RequestKey | None:
    """open_request's arguments for `response`'s turn: the messages without the turn's audio (the last
    user message's last part); None when they do not end with one."""
    last = messages[-1]
    if last["role"] != "user" or not last["content"] or last["content"][-1]["type"] != "audio":
        return None
    return ([*messages[:-1], {**last, "content": last["content"][:-1]}], sampling, talker,
            response.settings.voice.lower())


def _same(a: Any, b: Any) -> bool:
    """Equal, arrays by value (chat messages hold the user audio as numpy arrays)."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and (a is b or np.array_equal(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return a == b
