"""Realtime API (GA) events: client events parsed into typed models, server events as dicts that carry an
`event_id`, and `error` events in the API's shape ({type: "error", event_id, error: {type, code, message,
param, event_id}}, the last being the client event's id)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError

from omnistage.server.errors import validation_error

MAX_APPEND_CHARS = 15 << 20  # base64 characters in one input_audio_buffer.append, as OpenAI's limit


class RealtimeError(Exception):
    def __init__(self, message: str, param: str | None = None, code: str | None = "invalid_value",
                 type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message, self.param, self.code, self.type = message, param, code, type


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def server_event(type_: str, **fields: Any) -> dict:
    return {"type": type_, "event_id": new_id("event"), **fields}


def error_event(err: RealtimeError, client_event_id: str | None = None) -> dict:
    return server_event("error", error={"type": err.type, "code": err.code, "message": err.message,
                                        "param": err.param, "event_id": client_event_id})


def invalid(e: ValidationError, prefix: tuple = ()) -> RealtimeError:
    """The most specific pydantic error, its param named from the event's top (e.g. "session.voice")."""
    errors = [{**err, "loc": (*prefix, *err["loc"])} for err in e.errors()]
    err = validation_error(errors)
    return RealtimeError(err.message, err.param)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Event(_Strict):
    event_id: str | None = None


class ContentIn(_Strict):
    """A content part of an item a client sends: input_text / input_audio / input_image (user), input_text
    (system), output_text / output_audio with its transcript (assistant history)."""

    type: Literal["input_text", "input_audio", "input_image", "output_text", "output_audio"]
    text: str | None = None
    audio: str | None = None
    transcript: str | None = None
    image_url: str | None = None
    detail: Literal["auto", "low", "high"] | None = None


class ItemIn(_Strict):
    id: str | None = Field(None, max_length=64)
    type: Literal["message"]
    object: Literal["realtime.item"] | None = None
    status: Literal["completed", "incomplete", "in_progress"] | None = None
    role: Literal["user", "assistant", "system"]
    content: list[ContentIn] = Field(min_length=1)


class ResponseAudioOutput(_Strict):
    format: dict | None = None
    voice: str | None = None


class ResponseAudio(_Strict):
    output: ResponseAudioOutput | None = None


class ResponseParams(_Strict):
    """response.create's `response`, with the session's extensions (max_audio_frames, seed, ignore_eos)."""

    instructions: str | None = None
    output_modalities: list[Literal["text", "audio"]] | None = Field(None, min_length=1, max_length=1)
    audio: ResponseAudio | None = None
    max_output_tokens: int | Literal["inf"] | None = None
    max_audio_frames: int | None = Field(None, ge=1)
    seed: int | None = None
    ignore_eos: StrictBool | None = None
    conversation: Literal["auto", "none"] | None = None
    input: list[ItemIn] | None = None
    metadata: dict[str, str] | None = None


class SessionUpdate(_Event):
    type: Literal["session.update"]
    session: dict  # NOTE: validated after merging into the session's settings (settings.py)


class AudioAppend(_Event):
    type: Literal["input_audio_buffer.append"]
    audio: str = Field(max_length=MAX_APPEND_CHARS)


class AudioCommit(_Event):
    type: Literal["input_audio_buffer.commit"]


class AudioClear(_Event):
    type: Literal["input_audio_buffer.clear"]


class ItemCreate(_Event):
    type: Literal["conversation.item.create"]
    previous_item_id: str | None = None
    item: ItemIn


class ItemDelete(_Event):
    type: Literal["conversation.item.delete"]
    item_id: str


class ItemRetrieve(_Event):
    type: Literal["conversation.item.retrieve"]
    item_id: str


class ItemTruncate(_Event):
    type: Literal["conversation.item.truncate"]
    item_id: str
    content_index: int = Field(ge=0)
    audio_end_ms: int = Field(ge=0)


class ResponseCreate(_Event):
    type: Literal["response.create"]
    response: ResponseParams | None = None


class ResponseCancel(_Event):
    type: Literal["response.cancel"]
    response_id: str | None = None


ClientEvent = (SessionUpdate | AudioAppend | AudioCommit | AudioClear | ItemCreate | ItemDelete | ItemRetrieve
               | ItemTruncate | ResponseCreate | ResponseCancel)
EVENTS: dict[str, type[_Event]] = {cls.model_fields["type"].annotation.__args__[0]: cls
                                   for cls in ClientEvent.__args__}


def parse_event(data: str | bytes) -> tuple[ClientEvent | None, str | None, RealtimeError | None]:
    """(event, its event_id, None), or (None, the event_id if one could be read, the error)."""
    try:
        raw = json.loads(data)
    except (ValueError, RecursionError):
        return None, None, RealtimeError("The event is not valid JSON.", code="invalid_json")
    if not isinstance(raw, dict):
        return None, None, RealtimeError("An event is a JSON object.", code="invalid_json")
    event_id = raw.get("event_id") if isinstance(raw.get("event_id"), str) else None
    cls = EVENTS.get(raw.get("type"))  # type: ignore[arg-type]
    if cls is None:
        known = ", ".join(f"'{t}'" for t in EVENTS)
        return None, event_id, RealtimeError(f"Invalid value: {raw.get('type')!r}. Supported values are: "
                                             f"{known}.", "type")
    try:
        return cls.model_validate(raw), event_id, None
    except ValidationError as e:
        return None, event_id, invalid(e)


class EventSender:
    """A session's way out for its events, shut when the session closes. The session's parts (its player,
    transcriber) send through this, not through a method of the session: that cycle kept each closed session,
    its history and audio, until a garbage collection."""

    def __init__(self, send: Callable[[dict], Awaitable[None]]) -> None:
        self.send, self.closed = send, False

    async def __call__(self, event: dict) -> None:
        if not self.closed:
            await self.send(event)
