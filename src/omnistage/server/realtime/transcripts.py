"""The transcripts of audio answers, by id, so a later chat request can send an assistant turn as
`{"role": "assistant", "audio": {"id": ...}}` (chat completions' `message.audio.id`, a realtime response's
assistant item id). Bounded: least recently used entries go first; an entry lives until its `expires_at`."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from omnistage.server.responses import AUDIO_TTL_S

DEFAULT_CAPACITY = 1024


class TranscriptStore:
    def __init__(self, capacity: int = DEFAULT_CAPACITY, clock: Callable[[], float] = time.time) -> None:
        self.capacity, self.clock = capacity, clock
        self._entries: OrderedDict[str, tuple[str, float]] = OrderedDict()

    def put(self, audio_id: str, transcript: str, expires_at: float | None = None) -> None:
        """`expires_at`: unix seconds (default: now + AUDIO_TTL_S, as chat's `audio.expires_at`)."""
        expires_at = self.clock() + AUDIO_TTL_S if expires_at is None else expires_at
        self._entries[audio_id] = (transcript, expires_at)
        self._entries.move_to_end(audio_id)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, audio_id: str) -> str | None:
        entry = self._entries.get(audio_id)
        if entry is None:
            return None
        if entry[1] <= self.clock():
            del self._entries[audio_id]
            return None
        self._entries.move_to_end(audio_id)
        return entry[0]

    def __len__(self) -> int:
        return len(self._entries)
