"""The thinker's encoders off its step loop: requests with media go to this worker's thread, which encodes
whatever has queued in one call per kind (`encode_media`, through the encoder cache) on its own CUDA stream,
then hands each request with its rows to the stage's inbox (`Encoded`); the stage keeps stepping meanwhile.
The stage's stream waits on the rows' event before it reads them."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from omnistage.engine.request import Request
from omnistage.pipeline.faults import together
from omnistage.pipeline.thinker.encoder_cache import EncoderCache
from omnistage.pipeline.thinker.inputs import Media, encode_media


@dataclass
class Encoded:
    """A request with its encoder rows (or the error that encoding it raised) and the event they are ready at."""

    request: Request
    media: Media | None
    error: Exception | None = None
    ready: torch.cuda.Event | None = None

    def wait(self) -> None:
        """The current stream waits for the rows, which it then holds (the encoder's stream may not reuse
        their memory before the current stream is done with them)."""
        if self.ready is None or self.media is None:
            return
        stream = torch.cuda.current_stream()
        stream.wait_event(self.ready)
        audio, *visual = self.media
        for t in [audio, *(x for v in visual if v is not None for x in (v.embeds, *v.deepstack))]:
            if t is not None:
                t.record_stream(stream)


def has_media(req: Request) -> bool:
    p = req.prompt
    return any(x is not None for x in (p.input_features, p.image_grid_thw, p.video_grid_thw))


class EncoderWorker:
    def __init__(self, thinker: torch.nn.Module, cache: EncoderCache | None, out: Callable[[Encoded], None],
                 name: str = "thinker-encoders") -> None:
        p = next(thinker.parameters())
        self.thinker, self.cache, self.out, self.device, self.dtype = thinker, cache, out, p.device, p.dtype
        self.stream = torch.cuda.Stream(p.device) if p.device.type == "cuda" else None
        self.queue: queue.SimpleQueue[Request | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def add(self, req: Request) -> None:
        self.queue.put(req)

    def close(self) -> None:
        self.queue.put(None)
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        on_stream = torch.cuda.stream(self.stream) if self.stream is not None else nullcontext()
        with torch.inference_mode(), on_stream:
            while True:
                reqs = [self.queue.get()]
                while not self.queue.empty():
                    reqs.append(self.queue.get())
                live = [r for r in reqs if r is not None and not r.aborted]
                try:
                    items = self._encode(live)
                except BaseException as e:  # NOTE: a device error: the stage raises it as its own
                    items = [Encoded(r, None, e if isinstance(e, Exception) else RuntimeError(e)) for r in live]
                for item in items:
                    self.out(item)
                if None in reqs:
                    return

    def _encode(self, reqs: list[Request]) -> list[Encoded]:
        """All together; where that fails, each alone: only the request at fault fails (the stage raises
        its error as its own, a device error included)."""
        if len(reqs) > 1 and (media := together(self._media, reqs)) is not None:
            return self._ready([Encoded(r, m) for r, m in zip(reqs, media)])
        out = []
        for r in reqs:
            try:
                out.append(Encoded(r, self._media([r])[0]))
            except Exception as e:  # NOTE: handed to the stage, which fails the request (or itself)
                out.append(Encoded(r, None, e))
        return self._ready(out)

    def _media(self, reqs: list[Request]) -> list[Media]:
        return encode_media(self.thinker, [r.prompt for r in reqs], self.device, self.dtype, self.cache)

    def _ready(self, items: list[Encoded]) -> list[Encoded]:
        if self.stream is not None:
            event = torch.cuda.Event()
            event.record(self.stream)
            for item in items:
                item.ready = event
        return items
