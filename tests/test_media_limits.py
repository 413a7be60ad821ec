"""The deploy's `mm_processor_kwargs`: image and frame pixel limits that requests' own knobs apply within,
on a phone-sized photo (4032 x 3024)."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from omnistage.config import DeployConfig
from omnistage.config_loader import build_deploy_config
from omnistage.models.qwen3_omni.prompt import PromptProcessor
from omnistage.models.qwen3_omni.visual_processing import within

PHONE = Image.fromarray(np.random.default_rng(0).integers(0, 255, (3024, 4032, 3), dtype=np.uint8))


def image_tokens(processor: PromptProcessor, **options) -> int:
    out = processor([{"role": "user", "content": [{"type": "image", "image": PHONE, **options}, "What is it?"]}])
    return int(out.image_grid_thw.prod()) // 4


def test_a_phone_photo_is_capped_by_the_deploy_default_and_requests_stay_within(tiny_dir) -> None:
    capped = PromptProcessor(tiny_dir, limits=DeployConfig().mm_processor_kwargs)
    assert image_tokens(PromptProcessor(tiny_dir)) == 94 * 126  # the checkpoint's own max_pixels: 11 844
    assert image_tokens(capped) == 30 * 41  # 960 x 1312 pixels, <= 1280 x 32 x 32
    assert image_tokens(capped, max_pixels=12845056) == 30 * 41
    assert image_tokens(capped, max_pixels=256 * 32 * 32) == 13 * 18
    # a fixed size is scaled into the cap, then smart_resize applies its own default (1003520 pixels)
    assert image_tokens(capped, resized_height=3000, resized_width=4000) == 27 * 36
    assert image_tokens(PromptProcessor(tiny_dir), resized_height=3000, resized_width=4000) == 27 * 36


def test_within_and_the_config_check() -> None:
    assert within({"min_pixels": 10**7}, {"max_pixels": 10**6}) == {"min_pixels": 10**6, "max_pixels": 10**6}
    assert within({"max_pixels": 5}, {"max_pixels": 10}) == {"max_pixels": 5}
    cfg = build_deploy_config({"mm_processor_kwargs": {"video": {"total_pixels": 1000}}}, "cpu")
    assert cfg.mm_processor_kwargs == {"image": {"max_pixels": 1310720}, "video": {"total_pixels": 1000}}
    with pytest.raises(ValueError, match="mm_processor_kwargs"):
        build_deploy_config({"mm_processor_kwargs": {"image": {"max_frames": 3}}}, "cpu")
