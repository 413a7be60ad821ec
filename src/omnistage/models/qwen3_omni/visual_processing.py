"""Images and video frames -> vision-encoder patches through the checkpoint's image processor, without
torchvision (transformers' Qwen2-VL video processor needs it; PyPI's torchvision does not import beside
torch 2.13 CPU). The Pillow/numpy backend of the Qwen2-VL image processor (`Qwen2VLImageProcessorPil`, in
transformers 5.17 and 5.24) resizes, rescales and normalises images AND every video frame; frames are then
grouped `temporal_patch_size` at a time in the video processor's patch layout (`video_patches`), at the
Qwen3-Omni processor's own video size (`processor_video_size`).
NOTE: Pillow's bicubic resize differs slightly from torchvision's, which the video processor uses.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def processor_video_size() -> dict[str, int]:
    """The video size the Qwen3-Omni processor passes to its video processor (over the checkpoint's video
    config): a class attribute in transformers 5.24, `_defaults` in 5.17."""
    from transformers.models.qwen3_omni_moe import processing_qwen3_omni_moe as m

    own = getattr(m.Qwen3OmniMoeProcessor, "videos_kwargs", None) or m.Qwen3OmniMoeProcessorKwargs._defaults[
        "videos_kwargs"]
    return dict(own["size"])


def video_patches(frame_patches: np.ndarray, num_frames: int, temporal: int, channels: int, patch: int
                  ) -> tuple[np.ndarray, int]:
    """Per-frame image patches `[F * N, C * temporal * P * P]` (each frame repeated `temporal` times,
    as the image processor writes an image) -> video patches `[T * N, C * temporal * P * P]`, frames
    grouped `temporal` at a time (the last frame repeated to fill the last group), and T."""
    own = frame_patches.reshape(num_frames, -1, channels, temporal, patch, patch)[:, :, :, 0]
    pad = -num_frames % temporal
    own = np.concatenate([own, np.repeat(own[-1:], pad, 0)]) if pad else own
    t = own.shape[0] // temporal
    grouped = own.reshape(t, temporal, *own.shape[1:]).transpose(0, 2, 3, 1, 4, 5)
    return np.ascontiguousarray(grouped.reshape(t * own.shape[1], -1)), t


def frame_budget(options: dict[str, Any], num_frames: int, temporal: int, size: dict[str, int]
                 ) -> dict[str, Any]:
    """`total_pixels` (a whole video's budget) as a per-frame `max_pixels`, as qwen-omni-utils spreads it."""
    if "total_pixels" not in options:
        return options
    low = options.get("min_pixels", size["shortest_edge"])
    per_frame = min(options.get("max_pixels", size["longest_edge"]), options["total_pixels"] / num_frames * temporal)
    return {**options, "max_pixels": max(int(per_frame), int(low * 1.05))}


def within(options: dict[str, Any], limits: dict[str, int]) -> dict[str, Any]:
    """An item's options inside the deploy's limits (`mm_processor_kwargs`): a pixel cap it gives above the
    limit, or does not give, is the limit; a fixed size past `max_pixels` is scaled down to it."""
    out = dict(options)
    for key, cap in limits.items():
        out[key] = min(out[key], cap) if key in out else cap
    if "min_pixels" in out and "max_pixels" in out:
        out["min_pixels"] = min(out["min_pixels"], out["max_pixels"])
    if "resized_height" in out and "resized_width" in out and "max_pixels" in out:
        scale = min(1.0, (out["max_pixels"] / (out["resized_height"] * out["resized_width"])) ** 0.5)
        out["resized_height"], out["resized_width"] = (max(1, int(out[k] * scale))
                                                       for k in ("resized_height", "resized_width"))
    return out


class VisualProcessor:
    """Per-item options: `min_pixels`, `max_pixels`, `resized_height` with `resized_width`; videos also
    `total_pixels`; all within `limits` ({"image": {...}, "video": {...}}, see `within`)."""

    def __init__(self, model_dir: str, limits: dict[str, dict[str, int]] | None = None) -> None:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        self.image_processor = Qwen2VLImageProcessorPil.from_pretrained(model_dir)
        self.video_size = processor_video_size()
        self.merge_size = self.image_processor.merge_size
        self.limits = limits or {}

    def pixels(self, images: list[Any], options: dict[str, Any], default_size: dict[str, int]) -> dict[str, Any]:
        """The image processor's output (numpy) for `images` of one item, at its size options."""
        size = dict(default_size)
        size.update({k: options[o] for k, o in (("shortest_edge", "min_pixels"), ("longest_edge", "max_pixels"))
                     if o in options})
        kw: dict[str, Any] = {"size": size}
        if "resized_height" in options and "resized_width" in options:
            from PIL import Image
            from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

            ip = self.image_processor
            h, w = smart_resize(options["resized_height"], options["resized_width"], ip.patch_size * ip.merge_size)
            images = [Image.fromarray(np.asarray(im)).resize((w, h), Image.Resampling.BICUBIC) for im in images]
            kw["do_resize"] = False
        return self.image_processor(images=images, return_tensors="np", **kw)

    def images(self, images: list[Any], options: list[dict[str, Any]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(pixel_values [patches, C * T * P * P], image_grid_thw [n, 3])."""
        cap = self.limits.get("image", {})
        done = [self.pixels([im], within(opt, cap), self.image_processor.size) for im, opt in zip(images, options)]
        return (torch.from_numpy(np.concatenate([d["pixel_values"] for d in done])),
                torch.from_numpy(np.concatenate([d["image_grid_thw"] for d in done])))

    def videos(self, videos: list[Any], options: list[dict[str, Any]]
               ) -> tuple[torch.Tensor, torch.Tensor, list[float]]:
        """(pixel_values_videos, video_grid_thw [n, 3], seconds per temporal group) of videos with
        `frames` [T, H, W, 3] uint8 at `fps` (1 when unknown, as the processor assumes)."""
        ip, patches, grids = self.image_processor, [], []
        for video, opt in zip(videos, options):
            frames, opt = list(video.frames), within(opt, self.limits.get("video", {}))
            done = self.pixels(frames, frame_budget(opt, len(frames), ip.temporal_patch_size, self.video_size),
                              self.video_size)
            p, t = video_patches(done["pixel_values"], len(frames), ip.temporal_patch_size, 3, ip.patch_size)
            patches.append(p)
            grids.append([t, *done["image_grid_thw"][0, 1:].tolist()])
        seconds = [ip.temporal_patch_size / (v.fps or 1.0) for v in videos]
        return torch.from_numpy(np.concatenate(patches)), torch.tensor(grids), seconds
