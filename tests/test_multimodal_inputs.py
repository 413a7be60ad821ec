"""Multimodal inputs: 3-D M-RoPE positions (`rope_index`) against transformers' `get_rope_index` on random
prompt layouts, flat batch positions, the processor's per-item options."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from conftest import hf_reference
from mm_samples import TWO_TURNS, image, video
from test_thinker import thinker as thinker_module

from omnistage.models.qwen3_omni.make_tiny import tiny_checkpoint
from omnistage.models.qwen3_omni.presets import MM_IDS
from omnistage.models.qwen3_omni.prompt import PromptProcessor
from omnistage.models.qwen3_omni.rope_index import MRope, RopeSpec, audio_token_count, flat_positions, mrope_positions

M = {k[:-9]: v for k, v in MM_IDS.items()}  # "audio", "image", "video", "vision_start", ...


def layout(rng: random.Random, with_audio_in_video: bool):
    """Random text / audio / image / video (/ video with its audio) segments: ids, grids, seconds, mel frames."""
    ids, images, videos, seconds, mels = [1, 2, 3], [], [], [], []
    kinds = ["text", "audio", "image", "video", "both" if with_audio_in_video else "video"]
    for _ in range(rng.randint(0, 4)):
        kind = rng.choice(kinds)
        if kind == "text":
            ids += [rng.randint(10, 1000) for _ in range(rng.randint(1, 5))]
        elif kind == "audio":
            mels.append(rng.randint(20, 450))
            ids += [M["audio_start"], *[M["audio"]] * audio_token_count(mels[-1], 50), M["audio_end"]]
        else:
            grid = [1 if kind == "image" else rng.randint(1, 3), 2 * rng.randint(1, 4), 2 * rng.randint(1, 4)]
            tokens = [M["image" if kind == "image" else "video"]] * (grid[0] * grid[1] * grid[2] // 4)
            (images if kind == "image" else videos).append(grid)
            if kind != "image":
                seconds.append(rng.choice([2.0, 1.0, 0.5, 2 / 3, 0.4, 2 / 7]))
            if kind == "both":
                mels.append(rng.randint(8, 160))  # short tracks too: a track that ends before the frames' rows
                body = tokens + [M["audio"]] * audio_token_count(mels[-1], 50)
                rng.shuffle(body)  # only counts and the start markers decide positions
                ids += [M["vision_start"], M["audio_start"], *body, M["audio_end"], M["vision_end"]]
            else:
                ids += [M["vision_start"], *tokens, M["vision_end"]]
        ids.append(rng.randint(10, 1000))
    return ids, images, videos, seconds, mels


def test_positions_match_transformers_on_random_layouts() -> None:
    hf = hf_reference("tiny")
    # transformers 5.24 has it on the thinker's text model, 5.17 on the thinker
    rope_index = getattr(hf.thinker.model, "get_rope_index", None) or hf.thinker.get_rope_index
    spec = RopeSpec.from_config(hf.config)
    checked = {"3d": 0, "fractional": 0, "1d": 0, "refused": 0}
    for seed in range(400):
        rng = random.Random(seed)
        both = rng.random() < 0.5
        flag = both if rng.random() < 0.8 else not both  # also prompts read with the other flag (the talker)
        ids, images, videos, seconds, mels = layout(rng, both)
        grids = [torch.tensor(g) if g else None for g in (images, videos)]
        spg = torch.tensor(seconds) if seconds else None
        x = torch.tensor([ids])
        try:
            ref, delta = rope_index(x, *grids, torch.ones_like(x), flag, torch.tensor(mels) if mels else None, spg)
        except IndexError:  # a layout read with the other flag can run past the items given: so do we
            with pytest.raises(IndexError):
                mrope_positions(ids, spec, *grids, spg, mels, flag)
            checked["refused"] += 1
            continue
        ours = mrope_positions(ids, spec, *grids, spg, mels, flag)
        if ours is None:
            assert grids == [None, None] and torch.equal(ref[:, 0], torch.arange(len(ids)).float().expand(3, -1))
            checked["1d"] += 1
            continue
        assert torch.equal(ours.positions, ref[:, 0]), seed
        assert ours.delta == float(delta), seed
        checked["3d"] += 1
        checked["fractional"] += bool((ours.positions.frac() != 0).any())
    assert min(checked["3d"], checked["fractional"], checked["1d"]) >= 20 and checked["refused"] > 0, checked


def test_talker_spec_and_plain_text() -> None:
    config = hf_reference("tiny").config
    talker = RopeSpec.from_config(config, "talker")
    assert talker.spatial_merge_size == config.talker_config.spatial_merge_size
    assert talker.audio_n_window == config.thinker_config.audio_config.n_window  # the talker config has none
    assert mrope_positions([1, 2, 3], talker) is None


def test_flat_positions() -> None:
    m = MRope(torch.tensor([[0.0, 1, 2, 2], [0, 1, 2, 3], [0, 1, 3, 2]]), -2.5)
    assert flat_positions([(3, 1), (0, 2)], [None, None]).tolist() == [3, 0, 1]
    out = flat_positions([(5, 1), (2, 4), (0, 1)], [None, m, m])
    assert out.dtype == torch.float32 and out.shape == (3, 6)
    assert out[:, 0].tolist() == [5.0] * 3 and out[:, 5].tolist() == [0.0] * 3
    assert out[:, 1:3].tolist() == m.positions[:, 2:4].tolist()
    assert out[:, 3:5].tolist() == [[1.5, 2.5]] * 3  # past the prompt: index + delta


def test_processor_per_item_options() -> None:
    small = {"min_pixels": 32 * 32, "max_pixels": 64 * 64}
    parts = [{"type": "image", "image": image(6)}, {"type": "image", "image": image(6), **small},
             {"type": "image", "image": image(6), "resized_height": 64, "resized_width": 96},
             {"type": "video", "video": video(7), "min_pixels": 32 * 32, "max_pixels": 96 * 96},
             {"type": "video", "video": video(7), "min_pixels": 32 * 32, "max_pixels": 96 * 96,
              "total_pixels": 5 * 1024 // 2}]
    prompt = PromptProcessor(tiny_checkpoint("tiny"))([{"role": "user", "content": parts}])
    # the first at the real preprocessor_config's min_pixels 3136: 40 x 56 -> 64 x 96 (4 x 6 patches)
    assert prompt.image_grid_thw.tolist() == [[1, 4, 6], [1, 2, 4], [1, 4, 6]]
    # 36 x 52 frames -> 32 x 64; with total_pixels spread over 5 frames (1075 per frame) -> 32 x 32
    assert prompt.video_grid_thw.tolist() == [[3, 2, 4], [3, 2, 2]]
    assert prompt.input_ids.count(151655) == 6 + 2 + 6 and prompt.input_ids.count(151656) == 6 + 3


def test_encoders_batched_across_requests() -> None:
    from omnistage.pipeline.thinker.inputs import encode_media, encode_together

    thinker, processor = thinker_module("tiny"), PromptProcessor(tiny_checkpoint("tiny"))
    prompts = [processor(c, u) for c, u in (
        ([{"role": "user", "content": [{"type": "image", "image": image(40)}, {"type": "image", "image": image(41)}]}],
         False), (TWO_TURNS, True), ([{"role": "user", "content": "text"}], False))]
    calls = {"visual": 0, "audio": 0}
    hooks = [m.register_forward_hook(lambda *_, k=k: calls.__setitem__(k, calls[k] + 1))
             for k, m in (("visual", thinker.visual.merger), ("audio", thinker.audio_tower.ln_post))]  # once a forward
    try:
        with torch.no_grad():
            together = encode_together(thinker, prompts, torch.device("cpu"), torch.float32)
            alone = [encode_media(thinker, [p], torch.device("cpu"), torch.float32)[0] for p in prompts]
    finally:
        for h in hooks:
            h.remove()
    # together: one image call (3 images of 2 requests), one video call, one audio call (2 audios + a track)
    assert calls == {"visual": 2 + 3, "audio": 1 + 1}
    assert together[2] == (None, None, None) and together[0][0] is None and together[0][2] is None
    for t, a in zip(together, alone):
        for x, y in zip(t, a):
            if x is not None:
                rows = [(x, y)] if isinstance(x, torch.Tensor) else [(x.embeds, y.embeds), *zip(x.deepstack, y.deepstack)]
                for u, v in rows:
                    torch.testing.assert_close(u, v, rtol=0, atol=1e-6)
