"""Payloads between stages (O(1) per step after the first), the inbox each stage reads them from, and the
talker -> code2wav packet schedule."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

from omnistage.engine.request import Request

T = TypeVar("T")


@dataclass
class TalkerPrompt:
    """The first thinker->talker payload: what the talker prompt is built from."""

    prompt_ids: torch.Tensor  # [L] thinker prompt ids, on the host
    embeds: torch.Tensor  # [L, Ht] thinker input embeddings (encoder rows scattered in)
    mm_hidden: torch.Tensor | None  # [M, Ht] accept-layer hidden rows at the M multimodal positions
    ready: torch.cuda.Event | None = None  # `embeds` written on the thinker's stream (sent before its host sync)


@dataclass
class TextChunk:
    """One generated thinker token (its input embedding), or the end of the text (`finished`); a `prompt` with
    no `embed`: the talker prompt sent at the thinker's admission (pipeline/thinker/early_prompt.py)."""

    request: Request
    embed: torch.Tensor | None = None  # [Ht]
    prompt: TalkerPrompt | None = None  # only with the first token
    finished: bool = False


@dataclass
class FrameChunk:
    """One codec frame [G] for code2wav, or the end of the frames (`finished`). `talker_alone` (a request's
    first frame): the talker ran no other request, and had none waiting, when it made it."""

    request: Request
    frame: torch.Tensor | None = None
    finished: bool = False
    talker_alone: bool = False


class Inbox(Generic[T]):
    """A thread-safe FIFO; `put` never blocks, `drain` takes everything queued."""

    def __init__(self, wake: threading.Event | None = None) -> None:
        self._items: deque[T] = deque()
        self.wake = wake

    def __len__(self) -> int:
        return len(self._items)

    def put(self, item: T) -> None:
        self._items.append(item)
        if self.wake is not None:
            self.wake.set()

    def wait_drain(self, timeout: float) -> list[T]:
        """`drain`, after waiting up to `timeout` s for an item (needs `wake`)."""
        if self.wake.wait(timeout):
            self.wake.clear()
        return self.drain()

    def drain(self) -> list[T]:
        out = []
        while self._items:
            out.append(self._items.popleft())
        return out


def arrive(t: torch.Tensor, device: torch.device, ready: torch.cuda.Event | None = None) -> torch.Tensor:
    """A tensor from another stage's stream (or device), safe to use on this stage's stream (after `ready`, the
    producer's event, where the producer has not synchronized since writing it)."""
    if ready is not None:
        torch.cuda.current_stream(t.device).wait_event(ready)
    t = t.to(device, non_blocking=True)
    if t.is_cuda:
        # NOTE: without this the producer's allocator may reuse the memory while our stream still reads it.
        t.record_stream(torch.cuda.current_stream(t.device))
    return t


def packet_frames(emitted: int, initial: int, cap: int, growth: bool) -> int:
    """Frames in a stream's next audio packet after `emitted` frames (see ConnectorConfig)."""
    if emitted == 0:
        return initial
    return min(emitted, cap) if growth else cap


def later_packet_frames(initial: int, cap: int, growth: bool) -> list[int]:
    """Ascending: every length `packet_frames` gives a packet after the first (2, 25, growth: 2 4 8 16 25)."""
    shapes, emitted = set(), initial
    while (n := packet_frames(emitted, initial, cap, growth)) not in shapes:
        shapes.add(n)
        emitted += n
    return sorted(shapes)


@dataclass(frozen=True)
class PacketSchedule:
    """Which chunk a stream sends next: its packet's length (`packet_frames`) once it has that many frames (the
    rest, shorter, once they ended); `later`: the lengths of the code2wav graphs for later chunks."""

    cap: int
    growth: bool
    later: tuple[int, ...]  # every later packet length of the stream's first lengths, ascending

    @classmethod
    def of(cls, initials: Sequence[int], cap: int, growth: bool) -> PacketSchedule:
        return cls(cap, growth, tuple(sorted({n for i in initials for n in later_packet_frames(i, cap, growth)})))

    def next_chunk(self, emitted: int, initial: int, have: int, ended: bool) -> tuple[int, int]:
        """(frames, shape) of the chunk that goes now with `have` frames waiting (`ended`: no more come), else
        (0, 0)."""
        if not have:
            return 0, 0
        target = packet_frames(emitted, initial, self.cap, self.growth)
        return (min(have, target), target) if have >= target or ended else (0, 0)
