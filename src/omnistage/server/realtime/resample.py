"""24 kHz -> 16 kHz polyphase resampling of streams, fed in pieces of any length, many streams per call.

Output sample n is scipy's `resample_poly(x, 2, 3)[n]` of the whole float32 stream, bit for bit (same
float32 filter, same alignment): it is emitted once every input sample its filter reaches has arrived, so the
output never depends on how the input was cut (the stream's last ~10 samples wait for more input instead of
being zero-padded), nor on which other streams share the call (`push_many`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from scipy.signal import firwin, upfirdn

UP, DOWN = 2, 3
HALF_LEN = 10 * DOWN  # resample_poly's default filter: 2 * HALF_LEN + 1 taps, kaiser(5.0), cutoff 1 / DOWN
# NOTE: float32 taps, as resample_poly makes them for float32 input (float64 ones differ in the last bit)
TAPS = firwin(2 * HALF_LEN + 1, 1.0 / DOWN, window=("kaiser", 5.0)).astype(np.float32) * np.float32(UP)


def ready(fed: int) -> int:
    """How many output samples the stream's first `fed` input samples complete."""
    return max(0, (UP * (fed - 1) - HALF_LEN) // DOWN + 1)


class StreamResampler:
    """y[n] = sum_k TAPS[k] * u[3n + HALF_LEN - k], u the input upsampled by 2 (zeros between samples)."""

    def __init__(self) -> None:
        # NOTE: the kept input always starts at a multiple of DOWN, so upfirdn's output grid is the stream's.
        self._start = -HALF_LEN // UP  # the silence before the stream, as resample_poly pads it
        self._buf = np.zeros(-self._start, dtype=np.float32)
        self._next = 0  # next output index

    def push(self, x: np.ndarray) -> np.ndarray:
        """Append input samples (float); return the output samples they complete (float32)."""
        return push_many([self], [x])[0]

    def _take(self, y: np.ndarray, buf: np.ndarray) -> np.ndarray:
        """The outputs `buf` (the kept input and the new) completes, from upfirdn's `y` over it (or over it
        zero-padded on the right); keep the input later outputs need."""
        end = self._start + buf.size
        last = ready(end) - 1
        if last < self._next:
            self._buf = buf
            return np.zeros(0, dtype=np.float32)
        offset = HALF_LEN // DOWN - UP * self._start // DOWN  # upfirdn index of output 0
        out = y[self._next + offset:last + offset + 1]
        self._next = last + 1
        first_needed = -(-(DOWN * self._next - HALF_LEN) // UP)  # ceil: the first input the next output reads
        keep_from = first_needed - first_needed % DOWN
        self._buf = buf[keep_from - self._start:]
        self._start = keep_from
        return out.astype(np.float32)


def push_many(resamplers: list[StreamResampler], xs: list[np.ndarray]) -> list[np.ndarray]:
    """`r.push(x)` for each (distinct) resampler, in one upfirdn call over all streams' input as rows."""
    bufs = [np.concatenate([r._buf, x.astype(np.float32, copy=False)]) for r, x in zip(resamplers, xs)]
    rows = np.zeros((len(bufs), max(b.size for b in bufs)), dtype=np.float32)
    for row, buf in zip(rows, bufs):
        row[:buf.size] = buf  # NOTE: the zeros after a row reach no output its own input completes
    ys = upfirdn(TAPS, rows, UP, DOWN, axis=1)
    return [r._take(y, buf) for r, y, buf in zip(resamplers, ys, bufs)]


@dataclass
class Audio24k:
    """A stream's 24 kHz pcm16 since its last piece, and the 16 kHz windows it completes: `count` from
    `start` (output samples before `start` are skipped)."""

    pcm: np.ndarray
    start: int
    count: int


@dataclass(eq=False)
class WindowedStream:
    """A stream cut into 16 kHz windows: its resampler and the output not yet in a window."""

    resampler: StreamResampler = field(default_factory=StreamResampler)
    tail: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.float32))
    tail_at: int = 0  # the output sample of tail[0]

    def cut(self, new: np.ndarray, audio: Audio24k, window: int) -> list[np.ndarray]:
        self.tail = np.concatenate([self.tail, new])
        at, end = audio.start - self.tail_at, audio.start - self.tail_at + audio.count * window
        windows = [self.tail[i:i + window] for i in range(at, end, window)]
        self.tail, self.tail_at = self.tail[end:], audio.start + audio.count * window
        return windows


def windows_many(pieces: list[tuple[WindowedStream, Audio24k]], window: int) -> list[list[np.ndarray]]:
    """Each piece's windows, every (distinct) stream's audio resampled in one call."""
    if not pieces:
        return []
    xs = [a.pcm.astype(np.float32) / 32768.0 for _, a in pieces]
    news = push_many([s.resampler for s, _ in pieces], xs)
    return [s.cut(new, a, window) for (s, a), new in zip(pieces, news)]
