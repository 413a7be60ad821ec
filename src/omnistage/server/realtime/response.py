"""One realtime response: the engine's output stream of one request played out as the API's response
events (created, output item and content part added, text / audio deltas, their done events, response.done
with status and usage). It runs as its own task, so the session handles events while it plays; cancelling
the task (response.cancel, barge-in) aborts the request in every stage and truncates the answer to the audio
the client was sent."""

from __future__ import annotations

import asyncio
import base64
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from omnistage.outputs import OutputDelta, Usage
from omnistage.server.audio_format import to_pcm16
from omnistage.server.errors import OpenAIError
from omnistage.config import DeployConfig
from omnistage.media import MediaPolicy
from omnistage.sampling_params import SamplingParams, TalkerSamplingParams
from omnistage.server.realtime.conversation import Conversation, Item, Part, chat_messages, item_from
from omnistage.server.realtime.events import RealtimeError, ResponseParams, new_id, server_event
from omnistage.server.realtime.settings import Resolved, SessionSettings
from omnistage.server.realtime.timing import ResponseTimes
from omnistage.server.serving import RequestClock

logger = logging.getLogger(__name__)
Emit = Callable[[dict], Awaitable[None]]
FAILED = "The server had an error while processing your request."


def usage_object(usage: Usage) -> dict:
    out = usage.completion_tokens + usage.audio_frames
    return {"total_tokens": usage.prompt_tokens + out, "input_tokens": usage.prompt_tokens,
            "output_tokens": out, "input_token_details": {"cached_tokens": 0},
            "output_token_details": {"text_tokens": usage.completion_tokens,
                                     "audio_tokens": usage.audio_frames}}


@dataclass
class Response:
    settings: Resolved
    item: Item
    conversation: Conversation | None  # None: an out-of-band response (conversation "none")
    metadata: dict | None = None
    previous_item_id: str | None = None
    id: str = field(default_factory=lambda: new_id("resp"))
    status: str = "in_progress"
    status_details: dict | None = None
    cancel_reason: str | None = None
    usage: Usage = field(default_factory=Usage)
    times: ResponseTimes = field(default_factory=ResponseTimes)
    task: asyncio.Task | None = None

    @property
    def audio(self) -> bool:
        return self.settings.wants_audio

    def api(self) -> dict:
        done = self.status != "in_progress"
        return {"id": self.id, "object": "realtime.response", "status": self.status,
                "status_details": self.status_details, "output": [self.item.api()] if done else [],
                "conversation_id": None if self.conversation is None else "conversation",
                "output_modalities": self.settings.modalities,
                "max_output_tokens": self.settings.max_output_tokens,
                "audio": {"output": {"format": {"type": "audio/pcm", "rate": 24000},
                                     "voice": self.settings.voice}},
                "usage": usage_object(self.usage) if done else None, "metadata": self._metadata(done)}

    def _metadata(self, done: bool) -> dict | None:
        """The client's metadata, and once done what the server measured (timing.py)."""
        measured = self.times.metadata() if done else {}
        return {**(self.metadata or {}), **measured} if measured else self.metadata

    def _where(self) -> dict:
        return {"response_id": self.id, "item_id": self.item.id, "output_index": 0, "content_index": 0}

    def _part(self) -> dict:
        return ({"type": "audio", "transcript": self.item.text} if self.audio
                else {"type": "text", "text": self.item.text})

    def started(self) -> list[dict]:
        if self.conversation is not None:
            self.previous_item_id = self.conversation.add(self.item)
        return [server_event("response.output_item.added", response_id=self.id, output_index=0,
                             item=self.item.api()),
                *self._conversation_event("conversation.item.added"),
                server_event("response.content_part.added", **self._where(), part=self._part())]

    def deltas(self, delta: OutputDelta) -> list[dict]:
        """The events of one engine delta (recording what the client got)."""
        out = []
        if delta.text or delta.token_ids:
            self.item.add_text(delta.text, len(delta.token_ids))
            kind = "response.output_audio_transcript.delta" if self.audio else "response.output_text.delta"
            out.append(server_event(kind, **self._where(), delta=delta.text))
        if self.audio and delta.audio is not None and delta.audio.size:
            self.item.audio_samples += delta.audio.size
            self.times.audio(delta.audio.size)
            pcm = base64.b64encode(to_pcm16(delta.audio).tobytes()).decode()
            out.append(server_event("response.output_audio.delta", **self._where(), delta=pcm))
        return out

    def finish(self, last: OutputDelta) -> None:
        self.usage = last.usage or self.usage
        if last.finish_reason == "error":
            self.fail({"type": "server_error", "code": None, "message": FAILED})
        elif last.finish_reason == "length":
            self.status = "incomplete"
            self.status_details = {"type": "incomplete", "reason": "max_output_tokens"}
        else:
            self.status = "completed"

    def fail(self, error: dict) -> None:
        self.status, self.status_details = "failed", {"type": "failed", "error": error}

    def cancelled(self) -> None:
        self.status = "cancelled"
        self.status_details = {"type": "cancelled", "reason": self.cancel_reason or "client_cancelled"}
        if self.audio:
            self.item.truncate(self.item.audio_samples)
        self.item.status = "incomplete"

    def done(self, started: bool) -> list[dict]:
        if self.item.status == "in_progress":
            self.item.status = "completed" if self.status == "completed" else "incomplete"
        out = []
        if started:
            where = self._where()
            if self.audio:
                out += [server_event("response.output_audio.done", **where),
                        server_event("response.output_audio_transcript.done", **where,
                                     transcript=self.item.text)]
            else:
                out.append(server_event("response.output_text.done", **where, text=self.item.text))
            out += [server_event("response.content_part.done", **where, part=self._part()),
                    server_event("response.output_item.done", response_id=self.id, output_index=0,
                                 item=self.item.api()),
                    *self._conversation_event("conversation.item.done")]
        return [*out, server_event("response.done", response=self.api())]

    def _conversation_event(self, kind: str) -> list[dict]:
        if self.conversation is None:
            return []
        return [server_event(kind, previous_item_id=self.previous_item_id, item=self.item.api())]


def new_response(settings: SessionSettings, params: ResponseParams, conversation: Conversation,
                 voices: Sequence[str], deploy: DeployConfig, policy: MediaPolicy | None = None
                 ) -> tuple[Response, list[dict], SamplingParams, TalkerSamplingParams | None]:
    """A response to response.create's `params`, its prompt (the conversation's messages, or `input`'s, its
    images decoded under `policy`, None: the default one) and its sampling."""
    resolved = Resolved(settings, params, voices)
    sampling, talker = resolved.sampling(deploy)
    policy = policy or MediaPolicy()
    items = conversation.items if params.input is None else [
        item_from(item, policy, f"response.input[{i}]") for i, item in enumerate(params.input)]
    messages = chat_messages(resolved.instructions, items)
    if not messages:
        raise RealtimeError("The conversation is empty: add an item or send input before response.create.",
                            None, "conversation_empty")
    part = Part("output_audio" if resolved.wants_audio else "output_text")
    item = Item(new_id("item"), "assistant", [part], status="in_progress")
    response = Response(resolved, item, None if params.conversation == "none" else conversation,
                        params.metadata)
    return response, messages, sampling, talker


async def play(response: Response, start: Callable[[], Awaitable[AsyncIterator[OutputDelta]]],
               abort: Callable[[str], Awaitable[None]], emit: Emit, clock: RequestClock) -> None:
    """Runs `response`: `start()` admits its engine request; events go out through `emit`; `clock` sees
    every delta (the metrics' times)."""
    started, last = False, OutputDelta(response.id)
    try:
        deltas = await start()
        for event in response.started():
            await emit(event)
        started = True
        async for last in deltas:
            clock.saw(last)
            for event in response.deltas(last):
                await emit(event)
        response.finish(last)
    except OpenAIError as e:  # refused by the engine (bad media, overloaded, ...)
        response.fail({"type": e.type, "code": e.code, "message": e.message})
    except asyncio.CancelledError:
        response.cancelled()
    except Exception:
        logger.exception("realtime response %s failed", response.id)
        response.fail({"type": "server_error", "code": None, "message": FAILED})
    finally:
        if not last.finished:
            await asyncio.shield(abort(response.id))
    for event in response.done(started):
        await emit(event)
