"""OpenAI chat.completion / chat.completion.chunk bodies, SSE framing, and the model list."""

from __future__ import annotations

import base64
import json
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field

from omnistage.outputs import Usage

AUDIO_TTL_S = 24 * 3600
SSE_DONE = "data: [DONE]\n\n"


def usage_dict(usage: Usage) -> dict:
    """OpenAI usage: completion_tokens counts text tokens and codec frames (audio_tokens)."""
    completion = usage.completion_tokens + usage.audio_frames
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": completion,
            "total_tokens": usage.prompt_tokens + completion,
            "completion_tokens_details": {"text_tokens": usage.completion_tokens,
                                          "audio_tokens": usage.audio_frames}}


def audio_delta(data: bytes, audio_id: str | None = None) -> dict:
    """`delta` of a streamed audio chunk; the id rides on the first chunk only."""
    audio = {"id": audio_id} if audio_id else {}
    return {"audio": {**audio, "data": base64.b64encode(data).decode()}}


@dataclass
class ResponseHead:
    """What every response and chunk of one request shares."""

    model: str
    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))
    audio_id: str = field(default_factory=lambda: f"audio_{uuid.uuid4().hex}")

    @property
    def audio_expires_at(self) -> int:
        return self.created + AUDIO_TTL_S

    def completion(self, text: str, finish_reason: str, usage: Usage, audio: bytes | None = None) -> dict:
        """chat.completion; `audio` (a whole encoded file) goes into message.audio with the transcript."""
        message: dict = {"role": "assistant", "content": text}
        if audio is not None:
            message["audio"] = {"id": self.audio_id, "data": base64.b64encode(audio).decode(),
                                "expires_at": self.audio_expires_at, "transcript": text}
        choice = {"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": None}
        return {**self._head("chat.completion"), "choices": [choice], "usage": usage_dict(usage)}

    def chunk(self, delta: dict, finish_reason: str | None = None) -> dict:
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
        return {**self._head("chat.completion.chunk"), "choices": [choice]}

    def audio_done_chunk(self) -> dict:
        return self.chunk({"audio": {"expires_at": self.audio_expires_at}})

    def usage_chunk(self, usage: Usage) -> dict:
        return {**self._head("chat.completion.chunk"), "choices": [], "usage": usage_dict(usage)}

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}


def sse(event: dict) -> str:
    return f"data: {json.dumps(event, separators=(',', ':'))}\n\n"


def model_list(names: Iterable[str], created: int) -> dict:
    """GET /v1/models."""
    data = [{"id": n, "object": "model", "created": created, "owned_by": "omnistage"} for n in names]
    return {"object": "list", "data": data}
