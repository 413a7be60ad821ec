"""The vision encoder on static buffers: one CUDA graph per row bucket, all captured at start; the same function
run eagerly on the same buffers elsewhere (CPU: what the tests exercise).

Eagerly, one call launches ~700 kernels from Python, and each new patch count (every photo size) is slower the
first time: on the H200 a 640x480 photo's encoder took 6.5 ms of GPU time and 14.5 ms of wall time, and photos
of other sizes 32-44 ms the first time their size was seen, 17-24 ms after (`scripts/encoder_bench.py
--new-shapes`). A run holds
up to `max_frames` images / video frames; the rows past theirs, up to the bucket, form one padding sequence
(zero patches at position 0) that attends only to itself, and the frame slots past it are empty (their
offsets repeat). Padding rows are whole merge blocks, so no merged row mixes live and padding rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from omnistage.engine.cuda_graph import CUDAGraphs, batch_bucket, copy_in, fit_runs
from omnistage.models.qwen3_omni.encoders import VisualEmbeds
from omnistage.models.qwen3_omni.vision_encoder import vision_blocks, vision_layout

Grid = Sequence[int]  # (t, h, w)
# a 640x480 photo is 1 200 rows, 1280x720 3 520, a 4 s 320x240 video 4 frames of 320; the default pixel cap 5 120
VISION_ROWS = (*range(256, 2048 + 1, 256), *range(2560, 8192 + 1, 512))
VISION_FRAMES = 4


class VisionGraphRunner:
    def __init__(self, visual: nn.Module, buckets: Sequence[int], max_frames: int, device: torch.device) -> None:
        """Runs of up to max(buckets) patch rows of up to `max_frames` frames (an image is one)."""
        c, rows = visual.config, max(buckets)
        self.visual, self.buckets, self.max_frames = visual, sorted(buckets), max_frames
        self.merge = c.spatial_merge_size**2
        width = c.in_channels * c.temporal_patch_size * c.patch_size**2
        self.pixels = torch.zeros(rows, width, dtype=visual.dtype, device=device)
        self.pos = torch.zeros(rows, 2, dtype=torch.long, device=device)
        self.index = torch.zeros(rows, 4, dtype=torch.long, device=device)
        self.weight = torch.zeros(rows, 4, dtype=torch.float32, device=device)
        self.cu = torch.zeros(max_frames + 2, dtype=torch.int32, device=device)
        self.graphs: CUDAGraphs | None = CUDAGraphs() if device.type == "cuda" else None

    def fits(self, grids: Sequence[Grid]) -> bool:
        """Whether these images / videos go in one run."""
        return (sum(t * h * w for t, h, w in grids) <= self.buckets[-1]
                and sum(t for t, _, _ in grids) <= self.max_frames)

    def groups(self, grids: Sequence[Grid]) -> list[list[int]]:
        """Consecutive items in runs (a run's item indices), each within `fits`; an item that does not fit
        alone is a run of its own (`run` does not take it: the caller encodes it eagerly)."""
        return fit_runs(grids, self.fits)

    def capture(self) -> None:
        """Every bucket's graph now (on CUDA), largest first."""
        for b in reversed(self.buckets):
            self._capture(b)

    def run(self, pixels: Sequence[torch.Tensor], grids: Sequence[Grid]) -> VisualEmbeds:
        """Each item's patches `[t*h*w, C*T*P*P]` (host or device) with its grid (all within `fits`) -> their
        merged and DeepStack rows (copies: the graph's outputs are overwritten by the next run)."""
        rows = sum(x.shape[0] for x in pixels)
        b = batch_bucket(rows, self.buckets)
        self._capture(b)
        self._load(b, pixels, [list(g) for g in grids])
        merged, deepstack = self._forward(b) if self.graphs is None else self.graphs.replay(b)
        n = rows // self.merge
        return VisualEmbeds(merged[:n].clone(), [d[:n].clone() for d in deepstack])

    def _capture(self, b: int) -> None:
        if self.graphs is not None and b not in self.graphs:
            self._load(b, [], [])  # warm-up and capture: padding only
            self.graphs.capture(b, lambda: self._forward(b))

    def _load(self, b: int, pixels: Sequence[torch.Tensor], grids: list[list[int]]) -> None:
        rows = 0
        for x in pixels:  # NOTE: each item straight into the buffer (no joined copy on the host first)
            copy_in(self.pixels[rows:rows + x.shape[0]], x)
            rows += x.shape[0]
        frames: list[int] = []
        if grids:
            pos, index, weight, frames = vision_layout(self.visual, grids)
            # NOTE: non_blocking from pageable memory: small copies are staged at once (layers/context.to_device)
            for buf, x in ((self.pos, pos), (self.index, index), (self.weight, weight)):
                buf[:rows].copy_(x, non_blocking=True)
        for buf in (self.pixels, self.pos, self.index, self.weight):
            buf[rows:b].zero_()
        lens = [0, *frames, b - rows] + [0] * (self.max_frames - len(frames))
        self.cu.copy_(torch.tensor(lens, dtype=torch.int32).cumsum(0, dtype=torch.int32), non_blocking=True)

    def _forward(self, b: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        return vision_blocks(self.visual, self.pixels[:b], self.pos[:b], self.index[:b], self.weight[:b], self.cu,
                             b)
