"""A session's conversation: its items in order, and the chat `messages` they make, in the same shape the chat
endpoint passes to the engine (so a response's prompt is exactly that of the same conversation sent to
/v1/chat/completions): the session's instructions as the system message, user audio as audio (24 kHz pcm16
resampled to 16 kHz as the chat path's decoder does), user images as the chat path decodes them (images.py),
assistant turns as their transcripts. A committed user audio's transcript (input transcription) is shown on
its item; the prompt keeps the audio.

Truncation (barge-in, conversation.item.truncate): the talker speaks the thinker's token t in codec frame t,
so an answer cut after N frames of audio keeps the text of its first N tokens (whole text deltas, as they
came from the engine); that is the transcript the next turn's history holds.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
from PIL import Image

from omnistage.media import AUDIO_INPUT_RATE, MediaPolicy, resample
from omnistage.outputs import SAMPLE_RATE
from omnistage.server.realtime.events import ItemIn, RealtimeError, new_id
from omnistage.server.realtime.images import decode_image

SAMPLES_PER_FRAME = 1920  # code2wav's 24 kHz samples per codec frame


def decode_pcm(data: str, param: str) -> bytes:
    """base64 s16le -> its bytes; a RealtimeError for bad base64 or half a sample."""
    try:
        pcm = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise RealtimeError(f"{param}: not valid base64.", param, "invalid_base64") from None
    if len(pcm) % 2:
        raise RealtimeError(f"{param}: pcm16 audio has an even number of bytes, got {len(pcm)}.", param)
    return pcm


def pcm_float(pcm: bytes) -> np.ndarray:
    """s16le -> float32, with the same scaling as soundfile's read of a PCM_16 wav."""
    return np.frombuffer(pcm, "<i2").astype(np.float32) / 32768.0


def pcm_to_16k(pcm: bytes) -> np.ndarray:
    """s16le 24 kHz -> float32 16 kHz."""
    return resample(pcm_float(pcm), SAMPLE_RATE, AUDIO_INPUT_RATE)


def pcm_ms(num_bytes: int) -> int:
    return num_bytes // 2 * 1000 // SAMPLE_RATE


@dataclass
class Part:
    """One content part: input_text / output_text (`text`), input_audio (`pcm`, 24 kHz s16le; `transcript`
    once transcribed), input_image (`image`, decoded; `detail`), output_audio (`text` = its transcript)."""

    type: str
    text: str = ""
    pcm: bytes | None = None
    image: Image.Image | None = None
    detail: str | None = None
    transcript: str | None = None
    _audio16k: np.ndarray | None = None

    def api(self) -> dict:
        if self.type == "input_audio":
            return {"type": "input_audio", "transcript": self.transcript}
        if self.type == "input_image":  # NOTE: not the image_url echoed back: it can be megabytes
            return {"type": "input_image", "detail": self.detail or "auto"}
        key = "transcript" if self.type == "output_audio" else "text"
        return {"type": self.type, key: self.text}

    async def decode(self) -> None:
        """An input audio resampled for its chat part now, off the event loop (a 20 s turn: ~10 ms)."""
        if self.type == "input_audio" and self._audio16k is None:
            self._audio16k = await asyncio.to_thread(pcm_to_16k, self.pcm or b"")

    def chat_part(self) -> dict:
        if self.type == "input_image":
            return {"type": "image", "image": self.image}
        if self.type != "input_audio":
            return {"type": "text", "text": self.text}
        if self._audio16k is None:
            self._audio16k = pcm_to_16k(self.pcm or b"")
        return {"type": "audio", "audio": self._audio16k}


@dataclass
class Item:
    id: str
    role: str
    parts: list[Part]
    status: str = "completed"
    audio_samples: int = 0  # an answer's audio the client was sent
    deltas: list[tuple[str, int]] = field(default_factory=list)  # an answer's text deltas and their tokens

    def api(self) -> dict:
        return {"id": self.id, "type": "message", "object": "realtime.item", "status": self.status,
                "role": self.role, "content": [p.api() for p in self.parts]}

    def message(self) -> dict | None:
        """The chat message of this item; None for an answer the user heard nothing of."""
        parts = [p.chat_part() for p in self.parts if p.type in ("input_audio", "input_image") or p.text]
        return {"role": self.role, "content": parts} if parts else None

    @property
    def text(self) -> str:
        return "".join(t for t, _ in self.deltas)

    def add_text(self, text: str, tokens: int) -> None:
        self.deltas.append((text, tokens))
        self.parts[0].text = self.text

    def audio_cut(self, content_index: int, audio_end_ms: int) -> int:
        """The samples conversation.item.truncate keeps of this answer; a RealtimeError if it cannot."""
        if self.role != "assistant" or content_index >= len(self.parts) \
                or self.parts[content_index].type != "output_audio" or not self.audio_samples:
            raise RealtimeError("content_index: only an assistant item's output_audio (an answer of this "
                                "session) can be truncated.", "content_index")
        samples = audio_end_ms * SAMPLE_RATE // 1000
        if samples > self.audio_samples:
            raise RealtimeError(f"audio_end_ms: {audio_end_ms} ms is longer than the item's audio "
                                f"({self.audio_samples * 1000 // SAMPLE_RATE} ms).", "audio_end_ms")
        return samples

    def truncate(self, samples: int) -> None:
        """Keep the audio's first `samples` and the text of its first ceil(samples / frame) tokens."""
        keep, kept = math.ceil(samples / SAMPLES_PER_FRAME), []
        for text, tokens in self.deltas:
            keep -= tokens
            if keep < 0:
                break
            kept.append((text, tokens))
        self.deltas, self.audio_samples, self.status = kept, samples, "incomplete"
        self.parts[0].text = self.text


_ROLE_PARTS = {"user": ("input_text", "input_audio", "input_image"), "system": ("input_text",),
               "assistant": ("output_text", "output_audio")}


def item_from(item: ItemIn, policy: MediaPolicy, param: str = "item") -> Item:
    """A conversation.item.create item (or a response.create input item) as a completed Item; its images
    decoded under `policy`."""
    parts = []
    for i, c in enumerate(item.content):
        name = f"{param}.content[{i}]"
        if c.type not in _ROLE_PARTS[item.role]:
            raise RealtimeError(f"{name}.type: {item.role} items take {' or '.join(_ROLE_PARTS[item.role])}",
                                f"{name}.type")
        if c.type == "input_audio":
            if not c.audio:
                raise RealtimeError(f"{name}.audio: base64 pcm16 audio is required", f"{name}.audio")
            parts.append(Part("input_audio", pcm=decode_pcm(c.audio, f"{name}.audio")))
        elif c.type == "input_image":
            parts.append(Part("input_image", image=decode_image(c.image_url, policy, f"{name}.image_url"),
                              detail=c.detail))
        else:
            text = c.transcript if c.type == "output_audio" else c.text
            if text is None:
                key = "transcript" if c.type == "output_audio" else "text"
                raise RealtimeError(f"{name}.{key}: required", f"{name}.{key}")
            parts.append(Part(c.type, text))
    return Item(item.id or new_id("item"), item.role, parts)


def chat_messages(instructions: str, items: Iterable[Item]) -> list[dict]:
    system = [{"role": "system", "content": [{"type": "text", "text": instructions}]}] if instructions else []
    return system + [m for m in (item.message() for item in items) if m is not None]


class Conversation:
    def __init__(self) -> None:
        self.items: list[Item] = []

    def get(self, item_id: str, param: str = "item_id") -> Item:
        for item in self.items:
            if item.id == item_id:
                return item
        raise RealtimeError(f"{param}: no item with id {item_id!r} in the conversation.", param,
                            "item_not_found")

    def add(self, item: Item, previous_item_id: str | None = None) -> str | None:
        """Appends `item` (or puts it after `previous_item_id`; "root": first); returns the id before it."""
        if any(i.id == item.id for i in self.items):
            raise RealtimeError(f"item.id: an item with id {item.id!r} already exists.", "item.id",
                                "item_id_exists")
        if previous_item_id is None:
            at = len(self.items)
        elif previous_item_id == "root":
            at = 0
        else:
            at = self.items.index(self.get(previous_item_id, "previous_item_id")) + 1
        self.items.insert(at, item)
        return self.items[at - 1].id if at else None

    def delete(self, item_id: str) -> None:
        self.items.remove(self.get(item_id))

    def messages(self, instructions: str) -> list[dict]:
        return chat_messages(instructions, self.items)
