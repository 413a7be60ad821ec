"""Resized 8-bit pixels -> the vision encoder's float32 patches in one pass (`PatchMaker`).

The image processor rescales and normalises every value on its own (`(v * scale - mean[c]) / std[c]`), so its
output is a function of (channel, 8-bit value): `PatchMaker` asks the installed processor for that table once
(256 flat images through it) and then reads it in the patch layout, the 8-bit pixels permuted first. Equal to
the processor's patches bit for bit (`tests/test_visual_patches.py`), at a fraction of its passes over float
arrays; numpy's `take` runs without the GIL. In bfloat16 (the encoder's dtype on the GPU) the table is rounded
first, so the patches are those values rounded, in half the bytes (to copy to the GPU, or from a worker process).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def value_table(image_processor: Any) -> np.ndarray:
    """The processor's output for each 8-bit value per channel, float32 `[channels, 256]`."""
    p, m, t = image_processor.patch_size, image_processor.merge_size, image_processor.temporal_patch_size
    side = p * m  # one merge block: no resize, no padding
    flat = [np.full((side, side, 3), v, np.uint8) for v in range(256)]
    out = image_processor(images=flat, do_resize=False, return_tensors="np")["pixel_values"]
    per_value = out.reshape(256, m * m, 3, t * p * p)  # each value's image: its patches, each (C, T, P, P)
    if not (per_value == per_value[:, :1, :, :1]).all():
        raise ValueError("the image processor is not a per-value map of 8-bit pixels")
    return np.ascontiguousarray(per_value[:, 0, :, 0].T)


class PatchMaker:
    """Patches `[rows, C * T * P * P]` in the processor's row order (merge blocks of `m x m` patches in raster
    order; a video's temporal groups first), features (C, T, P, P)."""

    def __init__(self, image_processor: Any, dtype: torch.dtype = torch.float32) -> None:
        """`dtype`: the patches' (float32 as the processor's; bfloat16 / float16: its values rounded as
        `.to(dtype)` rounds them, half the bytes for an encoder that runs in that dtype)."""
        ip = image_processor
        self.patch, self.merge, self.temporal = ip.patch_size, ip.merge_size, ip.temporal_patch_size
        self.dtype = dtype
        table = torch.from_numpy(value_table(ip).reshape(-1)).to(dtype)
        # NOTE: numpy has no bfloat16: a 2-byte table is read as its bits (int16) and viewed back
        self.table = (table if dtype == torch.float32 else table.view(torch.int16)).numpy()
        self.offsets = (np.arange(3, dtype=np.uint16) * 256)[:, None, None, None]  # channel c: table[c]

    def image(self, rgb: np.ndarray) -> torch.Tensor:
        """An image `[H, W, 3]` uint8 (H and W multiples of patch x merge), as the processor writes an image:
        its one frame repeated `temporal` times."""
        return self._patches(rgb[None], 1)

    def video(self, frames: np.ndarray) -> tuple[torch.Tensor, int]:
        """Frames `[F, H, W, 3]` uint8 -> (patches of the `t` temporal groups, the last frame repeated to fill
        the last group, as the video processor groups them; t)."""
        pad = -len(frames) % self.temporal
        if pad:
            frames = np.concatenate([frames, np.repeat(frames[-1:], pad, 0)])
        return self._patches(frames, self.temporal), len(frames) // self.temporal

    def _patches(self, frames: np.ndarray, group: int) -> torch.Tensor:
        """`frames` in groups of `group` (1: each frame repeated `temporal` times) -> [rows, C*T*P*P]."""
        f, h, w, c = frames.shape
        p, m, t = self.patch, self.merge, self.temporal
        v = frames.reshape(f // group, group, h // (p * m), m, p, w // (p * m), m, p, c)
        # NOTE: permuted as 8-bit values (a quarter of the bytes), then read from the table in place
        index = np.ascontiguousarray(v.transpose(0, 2, 5, 3, 6, 8, 1, 4, 7)).astype(np.uint16)
        index += self.offsets  # (groups, h/pm, w/pm, m, m, C, group, P, P)
        values = np.take(self.table, index)
        if group == 1:
            out = np.empty((*values.shape[:6], t, p, p), values.dtype)
            out[...] = values
            values = out
        return torch.from_numpy(values.reshape(-1, c * t * p * p)).view(self.dtype)
