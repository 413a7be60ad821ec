"""silero-vad's core on many streams' windows in one call: window k of every stream that has one, k = 0, 1, ...,
each stream's recurrent state carried from its window to its next.

The loop over windows runs in TorchScript, which gives the GIL up for the whole call: beside a stage thread
running Python, each torch call from Python waits out the 5 ms switch interval to take the GIL back, so a VAD
that scored one window per call fell behind real time once streams had several windows waiting. The batch is
built in numpy, in pieces too small for numpy to give the GIL up. A stream's windows scored alone (one row) are
silero's own stateful calls bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

WINDOW = 512  # samples at 16 kHz: 32 ms
CONTEXT = 64  # samples of the previous window silero prepends
STATE_SHAPE = (2, 128)  # silero's LSTM (h, c) per stream
MAX_WINDOWS = 32  # a call's windows per stream (1 s): a longer backlog takes several calls


class _Windows(torch.nn.Module):
    def __init__(self, model: torch.jit.ScriptModule) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, state: torch.Tensor, live: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """x `[K, B, CONTEXT + WINDOW]`, rows by their window count (most first), state `[2, B, 128]`: window
        k of the first live[k] rows -> probabilities `[K, B]` (0 where a row has no window k), and the states
        after each row's last window."""
        probs = torch.zeros(x.shape[0], x.shape[1])
        for k in range(len(live)):
            n = live[k]
            prob, head = self.model(x[k, :n], state[:, :n].contiguous())
            probs[k, :n] = prob[:, 0]
            state = torch.cat([head, state[:, n:]], 1)
        return probs, state


@dataclass
class Batch:
    """Rows (streams) by their window count, most first: their inputs (each window with its context), the
    states they start from, and how many windows each has."""

    x: np.ndarray  # [K, B, CONTEXT + WINDOW]
    state: np.ndarray  # [2, B, 128]
    counts: list[int]

    def context(self, row: int) -> np.ndarray:
        """The row's context for its next window (the end of its last one here)."""
        return self.x[self.counts[row] - 1, row, -CONTEXT:]


def stack(rows: list[tuple[np.ndarray, np.ndarray, list[np.ndarray]]]) -> Batch:
    """A batch of rows (context, state, windows), given most windows first."""
    counts = [len(windows) for _, _, windows in rows]
    x = np.zeros((counts[0], len(rows), CONTEXT + WINDOW), np.float32)
    state = np.empty((STATE_SHAPE[0], len(rows), STATE_SHAPE[1]), np.float32)
    for b, (context, start, windows) in enumerate(rows):
        state[:, b] = start
        for k, window in enumerate(windows):
            x[k, b, :CONTEXT] = context if k == 0 else windows[k - 1][-CONTEXT:]
            x[k, b, CONTEXT:] = window
    return Batch(x, state, counts)


class Scorer:
    """silero's stateless core, `(context + window, state) -> (prob, state)`, over a Batch's windows."""

    def __init__(self) -> None:
        # NOTE: importing silero_vad calls torch.set_num_threads(1); with OpenMP that binds this thread only.
        torch.set_num_threads(1)
        from silero_vad import load_silero_vad

        self._windows = torch.jit.script(_Windows(load_silero_vad()._model))
        silent = np.zeros(WINDOW, np.float32)
        for _ in range(3):  # NOTE: TorchScript optimises its graph over the first calls (60, 9, then 1 ms)
            self(stack([(np.zeros(CONTEXT, np.float32), np.zeros(STATE_SHAPE, np.float32), [silent] * 2)]))

    def __call__(self, batch: Batch) -> tuple[np.ndarray, np.ndarray]:
        """Speech probabilities `[K, B]` and the rows' next states `[2, B, 128]`."""
        live = [sum(c > k for c in batch.counts) for k in range(batch.x.shape[0])]
        with torch.inference_mode():
            probs, state = self._windows(torch.from_numpy(batch.x), torch.from_numpy(batch.state), live)
        return probs.numpy(), state.numpy()
