"""What arrives at the thinker, encoded before it is admitted (`Arrivals`).

What a step takes from the inbox's queue is one `Arrival`: its requests' media go through the encoders (all at once,
`encode_together`) and its prompt pieces' audio too, then the requests are admitted and the pieces applied, in that
order. A step takes everything queued, or with the stage key `max_num_encoder_input_tokens` (vLLM's name) items in
order while their media tokens fit it (`take_within`), the rest left for the next steps: the encoders are GPU time
(a run of 4 photos 25-27 ms on an H100, `scripts/vision_run_cost.py`), and without a budget a burst's photos or
videos made thinker steps of 300-590 ms in which no running stream got a token (benchmarks/HISTORY.md, thirty-eighth
and thirty-ninth sections).
With the stage key `encoder_stream` (CUDA) the encoders run on a CUDA stream of their own: a step launches an
arrival's encoders there and goes on, and the arrival is admitted at the first step after they finished (at once,
waiting, when the thinker has nothing else to run). The encoders' graphs (their static buffers) are used on that
stream in order (a prompt started over is encoded on the thinker's stream, ordered between that stream's work); the
thinker's stream waits for an arrival's event before it reads the rows, whose memory is then marked as used there.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from omnistage.engine.request import Request
from omnistage.models.qwen3_omni.prompt import PromptInputs
from omnistage.pipeline.thinker.growth import PromptPiece
from omnistage.pipeline.thinker.inputs import Media


@dataclass
class Arrival:
    """`media[i]`: `reqs[i]`'s encoder rows (None: its encoding failed, recorded against it); `rows[j]`: the
    encoder rows of `pieces[j]`'s audio (None: none, or encoded when applied)."""

    reqs: list[Request]
    prompts: list[PromptInputs]
    media: list[Media | None]
    pieces: list[PromptPiece]
    rows: list[torch.Tensor | None] = field(default_factory=list)
    done: torch.cuda.Event | None = None


def media_tokens(item: Request | PromptPiece, mm_ids: frozenset[int]) -> int:
    """The encoder rows `item` brings: its prompt's (a piece's) audio, image and video placeholder tokens."""
    ids = item.input_ids if isinstance(item, PromptPiece) else item.prompt.input_ids
    return sum(1 for t in ids if t in mm_ids)


def take_within(queue: deque[tuple[Request | PromptPiece, int]], budget: int) -> list[Request | PromptPiece]:
    """Items from the front of `queue` (item, media tokens), in order, while their media tokens fit `budget`
    together (the first always goes; 0: no budget, all of them)."""
    out, spent = [], 0
    while queue and (not out or budget == 0 or spent + queue[0][1] <= budget):
        item, tokens = queue.popleft()
        out.append(item)
        spent += tokens
    return out


class Arrivals:
    """The arrivals whose encoders were launched, in order, and the encoders' stream (None: the thinker's)."""

    def __init__(self, device: torch.device, encoder_stream: bool) -> None:
        self.stream = torch.cuda.Stream(device) if encoder_stream and device.type == "cuda" else None
        self.queue: deque[Arrival] = deque()

    def __len__(self) -> int:
        return sum(len(a.reqs) for a in self.queue)

    @contextlib.contextmanager
    def encoding(self) -> Iterator[None]:
        """Encoder work launched inside runs on the encoders' stream (where there is one)."""
        with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
            yield

    @contextlib.contextmanager
    def encoding_now(self) -> Iterator[None]:
        """Encoder work launched inside runs on the thinker's stream (rows used at once), after the encoders'
        stream's work and before its next (the graphs' buffers are shared)."""
        if self.stream is None:
            yield
            return
        current = torch.cuda.current_stream(self.stream.device)
        current.wait_stream(self.stream)
        yield
        self.stream.wait_stream(current)

    def add(self, arrival: Arrival) -> None:
        """`arrival`, whose encoders were launched (`encoding`)."""
        if self.stream is not None:
            arrival.done = self.stream.record_event()
        self.queue.append(arrival)

    def ready(self, wait: bool) -> list[Arrival]:
        """The arrivals whose encoders finished, oldest first (`wait`: the oldest waited for), their rows made
        safe to read on the thinker's stream."""
        out = []
        while self.queue and (self.queue[0].done is None or self.queue[0].done.query() or (wait and not out)):
            arrival = self.queue.popleft()
            if arrival.done is not None and self.stream is not None:
                _used_on_current_stream(arrival, arrival.done)
            out.append(arrival)
        return out


def _used_on_current_stream(arrival: Arrival, done: torch.cuda.Event) -> None:
    stream = torch.cuda.current_stream()
    stream.wait_event(done)
    tensors = [t for m in arrival.media if m is not None for t in _media_tensors(m)]
    for t in [*tensors, *(r for r in arrival.rows if r is not None)]:
        t.record_stream(stream)  # NOTE: allocated on the encoders' stream: not reused before this stream's reads


def _media_tensors(media: Media) -> list[torch.Tensor]:
    audio, image, video = media
    out = [audio] if audio is not None else []
    for v in (image, video):
        if v is not None:
            out += [v.embeds, *v.deepstack]
    return out
