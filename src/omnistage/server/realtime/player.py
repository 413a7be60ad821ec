"""A session's responses, one playing at a time: a response made from the conversation (response.create's,
or server VAD's for a committed turn), its engine request started (the turn's request opened while it was
spoken, when the response is the one it was opened for: early_prefill.py), played as its own task
(response.py), cancelled (response.cancel, barge-in, the socket gone)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING

from omnistage.outputs import OutputDelta
from omnistage.sampling_params import SamplingParams, TalkerSamplingParams
from omnistage.server.realtime.conversation import Conversation
from omnistage.server.realtime.early_prefill import EarlyPrefill
from omnistage.server.realtime.events import RealtimeError, ResponseParams, server_event
from omnistage.server.realtime.response import Emit, Response, new_response, play
from omnistage.server.realtime.settings import SessionSettings
from omnistage.server.serving import RequestClock, StreamingInput, start_request

if TYPE_CHECKING:
    from omnistage.server.realtime.session import SessionContext


class Player:
    def __init__(self, ctx: SessionContext, early: EarlyPrefill, emit: Emit, session: str) -> None:
        """`session`: the session's id, which keeps its requests on one thinker replica (its prefix cache)."""
        self.ctx, self.early, self._emit, self.session = ctx, early, emit, session
        self.response: Response | None = None

    @property
    def playing(self) -> bool:
        return self.response is not None and self.response.task is not None and not self.response.task.done()

    async def respond(self, settings: SessionSettings, params: ResponseParams, conversation: Conversation,
                      decided: float | None = None) -> None:
        """`decided`: when server VAD ended the turn this answers (perf_counter; timing.py)."""
        if self.playing:
            raise RealtimeError(f"Conversation already has an active response in progress: "
                                f"{self.response.id}. Wait until the response is finished before creating a "
                                "new one.", None, "conversation_already_has_active_response")
        self.response, messages, sampling, talker = new_response(settings, params, conversation,
                                                                 self.ctx.voices, self.ctx.deploy,
                                                                 self.ctx.media)
        stream = await self.early.take(self.response, messages, sampling, talker)
        self.response.times.decided, self.response.times.created = decided, time.perf_counter()
        await self._emit(server_event("response.created", response=self.response.api()))
        self._start(self.response, messages, sampling, talker, stream)

    def _start(self, response: Response, messages: list[dict], sampling: SamplingParams,
               talker: TalkerSamplingParams | None, stream: StreamingInput | None) -> None:
        """The one place a response's prompt (the conversation's messages) becomes an engine request: the
        spoken turn's open request `stream` (closed with its clip) when it took one."""
        voice = response.settings.voice.lower()

        def start() -> Awaitable[AsyncIterator[OutputDelta]]:
            if stream is not None:
                return self.early.close(stream, messages)
            return start_request(self.ctx.engine, response.id, messages, sampling, talker, voice,
                                 session=self.session)

        response.task = asyncio.create_task(self._play(response, start))

    async def _play(self, response: Response,
                    start: Callable[[], Awaitable[AsyncIterator[OutputDelta]]]) -> None:
        clock = RequestClock()
        await play(response, start, self.ctx.engine.abort, self._emit, clock)
        if response.status in ("completed", "incomplete"):  # answers that ran their course
            clock.report(self.ctx.metrics)
        if response.audio and response.conversation is not None:
            self.ctx.transcripts.put(response.item.id, response.item.parts[0].text)

    async def cancel(self, reason: str) -> bool:
        """Stops the playing response (its request aborted in every stage, its answer truncated to what was
        sent) and waits until its response.done is out. False when none is playing. The open request of a
        turn being spoken is aborted too (its prompt holds the answer being cut)."""
        await self.early.abort()
        if not self.playing:
            return False
        self.response.cancel_reason = reason
        self.response.task.cancel()
        await asyncio.wait([self.response.task])
        await self.early.cancelled()
        return True
