"""The audio tower on static buffers: one CUDA graph per chunk bucket (2^k chunks of 100 mel frames), all
captured at start; the same function run eagerly on the same buffers elsewhere (CPU: what the tests exercise).

Eagerly, one call launches every layer's kernels from Python (32 layers at full size), and every new clip length
costs more the first time (`scripts/encoder_bench.py --new-shapes`: 22-50 ms against 8 on the H200). A run holds up
to max(buckets) chunks, each padded to 100 frames with zeros (what the convs see past a short chunk either way:
their own zero padding). The rows past the clips' (short chunks' tails, padding chunks) form one padding window
that attends only to itself; the window slots past it are empty (their offsets repeat).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from omnistage.engine.cuda_graph import CUDAGraphs, batch_bucket, copy_in, fit_runs
from omnistage.models.qwen3_omni.audio_encoder import audio_layout, conv_rows, encode_rows
from omnistage.models.qwen3_omni.rope_index import audio_token_count

AUDIO_CHUNKS = (1, 2, 4, 8, 16, 32, 64)  # a 2.4 s question is 3 chunks; 64 chunks 64 s of audio


class AudioGraphRunner:
    def __init__(self, tower: nn.Module, buckets: Sequence[int], device: torch.device) -> None:
        """Runs of up to max(buckets) chunks."""
        self.tower, self.buckets = tower, sorted(buckets)
        self.chunk = tower.n_window * 2
        self.rows = audio_token_count(self.chunk, tower.n_window)  # rows of a full chunk after the convs
        n = self.buckets[-1]
        dtype = tower.conv2d1.weight.dtype
        self.chunks = torch.zeros(n, 1, tower.config.num_mel_bins, self.chunk, dtype=dtype, device=device)
        self.index = torch.zeros(n * self.rows, dtype=torch.long, device=device)
        self.cu = torch.zeros(n + 2, dtype=torch.int32, device=device)  # a clip has no more windows than chunks
        self.graphs: CUDAGraphs | None = CUDAGraphs() if device.type == "cuda" else None

    def num_chunks(self, lens: Sequence[int]) -> int:
        return sum(-(-n // self.chunk) for n in lens)

    def fits(self, lens: Sequence[int]) -> bool:
        """Whether clips of `lens` frames go in one run."""
        return self.num_chunks(lens) <= self.buckets[-1]

    def groups(self, lens: Sequence[int]) -> list[list[int]]:
        """Consecutive clips in runs (their indices), each within `fits`; a clip that does not fit alone is a
        run of its own (`run` does not take it: the caller encodes it eagerly)."""
        return fit_runs(lens, self.fits)

    def capture(self) -> None:
        """Every bucket's graph now (on CUDA), largest first."""
        for b in reversed(self.buckets):
            self._capture(b)

    def run(self, features: torch.Tensor, lens: Sequence[int]) -> torch.Tensor:
        """Clips' log-mel frames `[mels, sum(lens)]` (host or device; all within `fits`) -> their audio token
        rows (a copy: the graph's output is overwritten by the next run)."""
        b = batch_bucket(self.num_chunks(lens), self.buckets)
        self._capture(b)
        live = self._load(b, features, list(lens))
        out = self._forward(b) if self.graphs is None else self.graphs.replay(b)
        return out[:live].clone()

    def _capture(self, b: int) -> None:
        if self.graphs is not None and b not in self.graphs:
            self._load(b, None, [])  # warm-up and capture: padding only
            self.graphs.capture(b, lambda: self._forward(b))

    def _load(self, b: int, features: torch.Tensor | None, lens: list[int]) -> int:
        """The run's chunks, row index and windows into the buffers; its live rows."""
        rows = self.rows
        chunks, valid, windows = audio_layout(lens, self.tower.n_window, self.tower.n_window_infer, rows)
        if chunks:
            padded = nn.utils.rnn.pad_sequence(features.T.split(chunks), batch_first=True)  # [C, frames, mels]
            padded = F.pad(padded, (0, 0, 0, self.chunk - padded.shape[1])).transpose(1, 2)
            copy_in(self.chunks[:len(chunks), 0], padded)
        self.chunks[len(chunks):b].zero_()
        live = len(valid)
        self.index[:b * rows].copy_(torch.tensor(valid + [0] * (b * rows - live)), non_blocking=True)
        seqs = [0, *windows, b * rows - live] + [0] * (b - len(windows))
        self.cu[:b + 2].copy_(torch.tensor(seqs, dtype=torch.int32).cumsum(0, dtype=torch.int32), non_blocking=True)
        return live

    def _forward(self, b: int) -> torch.Tensor:
        x = conv_rows(self.tower, self.chunks[:b])
        h = torch.index_select(x.reshape(-1, x.shape[-1]), 0, self.index[:b * self.rows])
        return encode_rows(self.tower, h, self.cu[:b + 2], b * self.rows)
