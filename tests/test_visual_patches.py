"""Images and video frames -> patches (`visual_patches.PatchMaker`, `VisualProcessor`) against transformers'
Qwen2-VL image processor (Pillow backend) and the video processor's patch layout: equal bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from mm_samples import image, video
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

from omnistage.models.qwen3_omni.make_tiny import tiny_checkpoint
from omnistage.models.qwen3_omni.visual_processing import VisualProcessor, frame_budget


@pytest.fixture(scope="module")
def vp() -> VisualProcessor:
    return VisualProcessor(str(tiny_checkpoint("tiny")))


def reference_image(vp: VisualProcessor, im: Image.Image, options: dict, default: dict | None = None
                    ) -> tuple[np.ndarray, list[int]]:
    """transformers' processor on one image at the item's options (a fixed size resized by Pillow first) over
    `default` (the image size)."""
    ip = vp.image_processor
    size = dict(default or ip.size)
    size.update({k: options[o] for k, o in (("shortest_edge", "min_pixels"), ("longest_edge", "max_pixels"))
                 if o in options})
    kw = {"size": size}
    if "resized_height" in options:
        h, w = smart_resize(options["resized_height"], options["resized_width"], ip.patch_size * ip.merge_size)
        im, kw["do_resize"] = im.resize((w, h), Image.Resampling.BICUBIC), False
    out = ip(images=[im], return_tensors="np", **kw)
    return out["pixel_values"], out["image_grid_thw"][0].tolist()


@pytest.mark.parametrize("h, w, options", [(40, 56, {}), (97, 131, {}), (300, 451, {"max_pixels": 128 * 128}),
                                           (64, 64, {"min_pixels": 96 * 96}),
                                           (50, 70, {"resized_height": 64, "resized_width": 100})])
def test_images_equal_the_image_processor(vp: VisualProcessor, h: int, w: int, options: dict) -> None:
    im = image(h * w, h, w)
    pixels, grid = vp.images([im], [options])
    ref, ref_grid = reference_image(vp, im, options)
    assert grid.tolist() == [ref_grid] and pixels.dtype == torch.float32
    assert np.array_equal(pixels.numpy(), ref)


def test_every_8_bit_value_and_several_images(vp: VisualProcessor) -> None:
    ramp = Image.fromarray(np.arange(64 * 96 * 3, dtype=np.int64).reshape(64, 96, 3).astype(np.uint8) ^ 0x5A)
    ims = [ramp, image(3, 33, 47), image(4, 128, 32)]
    pixels, grids = vp.images(ims, [{}] * 3)
    refs = [reference_image(vp, im, {}) for im in ims]
    assert grids.tolist() == [g for _, g in refs]
    assert np.array_equal(pixels.numpy(), np.concatenate([r for r, _ in refs]))


@pytest.mark.parametrize("frames, options", [(1, {}), (4, {}), (5, {"max_pixels": 40 * 40}),
                                             (6, {"total_pixels": 6 * 1024})])
def test_videos_equal_the_video_processor_layout(vp: VisualProcessor, frames: int, options: dict) -> None:
    """Each frame resized and normalised as the image processor does it, laid out as transformers' video
    processor lays frames out: (t, h/m, w/m, m, m) rows of (C, temporal, P, P), the last frame repeated."""
    v = video(frames, frames=frames)
    pixels, grids, seconds = vp.videos([v], [options])
    ip = vp.image_processor
    c, tp, p, m = 3, ip.temporal_patch_size, ip.patch_size, ip.merge_size
    opt = frame_budget(options, frames, tp, vp.video_size)
    resized = [reference_image(vp, Image.fromarray(f), opt, vp.video_size) for f in v.frames]
    gh, gw = resized[0][1][1:]
    # the image processor's own patches of each frame, back to [C, H, W] (its first temporal copy)
    per = [torch.from_numpy(r).view(gh // m, gw // m, m, m, c, tp, p, p)[:, :, :, :, :, 0] for r, _ in resized]
    norm = torch.stack([x.permute(4, 0, 2, 5, 1, 3, 6).reshape(c, gh * p, gw * p) for x in per])
    padded = torch.cat([norm, norm[-1:].expand(-frames % tp, -1, -1, -1)])
    t = padded.shape[0] // tp
    ref = padded.view(t, tp, c, gh // m, m, p, gw // m, m, p).permute(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(t * gh * gw, -1)
    assert grids.tolist() == [[t, gh, gw]] and seconds == [tp / v.fps]
    assert torch.equal(pixels, ref)


def test_bfloat16_patches_are_the_float32_ones_rounded(vp: VisualProcessor) -> None:
    half = VisualProcessor(str(tiny_checkpoint("tiny")), dtype=torch.bfloat16)
    ims, opts = [image(5, 97, 131), image(6, 64, 64)], [{}, {"min_pixels": 96 * 96}]
    (a, ga), (b, gb) = half.images(ims, opts), vp.images(ims, opts)
    assert a.dtype == torch.bfloat16 and torch.equal(ga, gb) and torch.equal(a, b.to(torch.bfloat16))
    v = video(9, frames=5)
    (a, ga, _), (b, gb, _) = half.videos([v], [{}]), vp.videos([v], [{}])
    assert a.dtype == torch.bfloat16 and torch.equal(ga, gb) and torch.equal(a, b.to(torch.bfloat16))
