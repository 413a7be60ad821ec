"""24 kHz -> 16 kHz polyphase resampling of a stream, fed in pieces of any length.

Output sample n is scipy's `resample_poly(x, 2, 3)[n]` of the whole float32 stream, bit for bit (same
float32 filter, same alignment): it is emitted once every input sample its filter reaches has arrived, so the
output never depends on how the input was cut (the stream's last ~10 samples wait for more input instead of
being zero-padded).
"""

from __future__ import annotations

import numpy as np
from scipy.signal import firwin, upfirdn

UP, DOWN = 2, 3
HALF_LEN = 10 * DOWN  # resample_poly's default filter: 2 * HALF_LEN + 1 taps, kaiser(5.0), cutoff 1 / DOWN
# NOTE: float32 taps, as resample_poly makes them for float32 input (float64 ones differ in the last bit)
TAPS = firwin(2 * HALF_LEN + 1, 1.0 / DOWN, window=("kaiser", 5.0)).astype(np.float32) * np.float32(UP)


class StreamResampler:
    """y[n] = sum_k TAPS[k] * u[3n + HALF_LEN - k], u the input upsampled by 2 (zeros between samples)."""

    def __init__(self) -> None:
        # NOTE: the kept input always starts at a multiple of DOWN, so upfirdn's output grid is the stream's.
        self._start = -HALF_LEN // UP  # the silence before the stream, as resample_poly pads it
        self._buf = np.zeros(-self._start, dtype=np.float32)
        self._next = 0  # next output index

    def push(self, x: np.ndarray) -> np.ndarray:
        """Append input samples (float); return the output samples they complete (float32)."""
        self._buf = np.concatenate([self._buf, x.astype(np.float32, copy=False)])
        end = self._start + self._buf.size
        last = (UP * (end - 1) - HALF_LEN) // DOWN  # the last output whose filter lies inside the input
        if last < self._next:
            return np.zeros(0, dtype=np.float32)
        offset = HALF_LEN // DOWN - UP * self._start // DOWN  # upfirdn index of output 0
        out = upfirdn(TAPS, self._buf, UP, DOWN)[self._next + offset:last + offset + 1]
        self._next = last + 1
        first_needed = -(-(DOWN * self._next - HALF_LEN) // UP)  # ceil: the first input the next output reads
        keep_from = first_needed - first_needed % DOWN
        self._buf = self._buf[keep_from - self._start:]
        self._start = keep_from
        return out.astype(np.float32)
