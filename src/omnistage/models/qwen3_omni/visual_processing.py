"""Images and video frames -> vision-encoder patches as the checkpoint's image processor makes them, without
torchvision (transformers' Qwen2-VL video processor needs it; PyPI's torchvision does not import beside
torch 2.13 CPU). As the Pillow/numpy backend of the Qwen2-VL image processor (`Qwen2VLImageProcessorPil`, in
transformers 5.17 and 5.24) does for images AND every video frame: Pillow's resize to whole merge blocks
(`resized`), then its rescale, normalisation and patch layout, made in one pass by `visual_patches.PatchMaker`
(equal to the processor's output); video frames grouped `temporal_patch_size` at a time in the video
processor's patch layout, at the Qwen3-Omni processor's own video size (`processor_video_size`).
NOTE: Pillow's bicubic resize differs slightly from torchvision's, which the video processor uses.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from omnistage.models.qwen3_omni.visual_patches import PatchMaker


def processor_video_size() -> dict[str, int]:
    """The video size the Qwen3-Omni processor passes to its video processor (over the checkpoint's video
    config): a class attribute in transformers 5.24, `_defaults` in 5.17."""
    from transformers.models.qwen3_omni_moe import processing_qwen3_omni_moe as m

    own = getattr(m.Qwen3OmniMoeProcessor, "videos_kwargs", None) or m.Qwen3OmniMoeProcessorKwargs._defaults[
        "videos_kwargs"]
    return dict(own["size"])


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

    def __init__(self, model_dir: str, limits: dict[str, dict[str, int]] | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
        """`dtype`: the patches' (`PatchMaker`)."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        self.image_processor = Qwen2VLImageProcessorPil.from_pretrained(model_dir)
        self.patches = PatchMaker(self.image_processor, dtype)
        self.video_size = processor_video_size()
        self.merge_size = self.image_processor.merge_size
        self.limits = limits or {}

    def resized(self, image: Any, options: dict[str, Any], default_size: dict[str, int]) -> np.ndarray:
        """An image (PIL, or `[H, W, 3]` uint8) resized as the image processor resizes it at the item's size
        options (a fixed `resized_height` x `resized_width` to whole merge blocks): `[H', W', 3]` uint8."""
        from PIL import Image
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        ip = self.image_processor
        im = image if isinstance(image, Image.Image) else Image.fromarray(np.asarray(image))
        factor = ip.patch_size * ip.merge_size
        if "resized_height" in options and "resized_width" in options:
            h, w = smart_resize(options["resized_height"], options["resized_width"], factor)
        else:
            h, w = smart_resize(im.height, im.width, factor, options.get("min_pixels", default_size["shortest_edge"]),
                                options.get("max_pixels", default_size["longest_edge"]))
        return np.asarray(im.resize((w, h), ip.resample))

    def images(self, images: list[Any], options: list[dict[str, Any]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(pixel_values [patches, C * T * P * P], image_grid_thw [n, 3])."""
        cap, p = self.limits.get("image", {}), self.image_processor.patch_size
        rgb = [self.resized(im, within(opt, cap), self.image_processor.size) for im, opt in zip(images, options)]
        return (torch.cat([self.patches.image(x) for x in rgb]),
                torch.tensor([[1, x.shape[0] // p, x.shape[1] // p] for x in rgb]))

    def videos(self, videos: list[Any], options: list[dict[str, Any]]
               ) -> tuple[torch.Tensor, torch.Tensor, list[float]]:
        """(pixel_values_videos, video_grid_thw [n, 3], seconds per temporal group) of videos with
        `frames` [T, H, W, 3] uint8 at `fps` (1 when unknown, as the processor assumes)."""
        ip, patches, grids = self.image_processor, [], []
        for video, opt in zip(videos, options):
            opt = frame_budget(within(opt, self.limits.get("video", {})), len(video.frames), ip.temporal_patch_size,
                               self.video_size)
            frames = np.stack([self.resized(f, opt, self.video_size) for f in video.frames])
            p, t = self.patches.video(frames)
            patches.append(p)
            grids.append([t, frames.shape[1] // ip.patch_size, frames.shape[2] // ip.patch_size])
        seconds = [ip.temporal_patch_size / (v.fps or 1.0) for v in videos]
        return torch.cat(patches), torch.tensor(grids), seconds
