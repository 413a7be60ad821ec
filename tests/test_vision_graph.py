"""The vision encoder on static buffers (`VisionGraphRunner`): padded runs equal the encoder's forward (CPU:
the same function run eagerly; CUDA: the captured graphs, within bf16 rounding), runs grouped within their
limits, and an admission that uses them encodes as the eager path does."""

from __future__ import annotations

import pytest
import torch
from test_encoder_attention import VISION, seeded

from omnistage.models.qwen3_omni.encoders import build_visual, encode_visual
from omnistage.pipeline.thinker.vision_graph import VisionGraphRunner

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]


def _visual(device: str) -> torch.nn.Module:
    return seeded(build_visual, VISION, device)


def _pixels(grids: list[list[int]], seed: int) -> torch.Tensor:
    rows = sum(t * h * w for t, h, w in grids)
    return torch.randn(rows, 3 * 2 * 16 * 16, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("device", DEVICES)
@torch.inference_mode()
def test_runs_equal_the_forward(device: str) -> None:
    visual = _visual(device)
    runner = VisionGraphRunner(visual, (64, 128, 256), 4, torch.device(device))
    runner.capture()
    tol = {"rtol": 0, "atol": 1e-5} if device == "cpu" else {"rtol": 2e-2, "atol": 2e-2}
    for seed, grids in enumerate([[[1, 8, 12]], [[1, 6, 6], [1, 4, 4]], [[4, 6, 8]], [[1, 2, 2]],
                                  [[1, 16, 16]], [[2, 4, 6], [1, 2, 4], [1, 6, 10]]]):
        pixels = _pixels(grids, seed)
        assert runner.fits(grids)
        ours = runner.run(pixels.split([t * h * w for t, h, w in grids]), grids)  # host pixels, copied in
        ref = encode_visual(visual, pixels.to(device), torch.tensor(grids))
        assert ours.embeds.shape == ref.embeds.shape and len(ours.deepstack) == len(ref.deepstack) == 3
        for a, b in [(ours.embeds, ref.embeds), *zip(ours.deepstack, ref.deepstack)]:
            torch.testing.assert_close(a.float(), b.float(), **tol)
    if device == "cuda":
        assert set(runner.graphs.graphs) == {64, 128, 256}  # all at start, none while running


def test_groups_keep_each_run_within_its_limits() -> None:
    runner = VisionGraphRunner(_visual("cpu"), (64, 128), 4, torch.device("cpu"))
    grids = [[1, 8, 8], [1, 4, 8], [1, 4, 4], [4, 4, 2], [1, 16, 16], [1, 2, 2], [1, 2, 2], [1, 2, 2], [1, 2, 2],
             [1, 2, 2]]
    runs = runner.groups(grids)
    assert runs == [[0, 1, 2], [3], [4], [5, 6, 7, 8], [9]]
    assert [runner.fits([grids[j] for j in r]) for r in runs] == [True, True, False, True, True]


@torch.inference_mode()
def test_admission_through_the_runner_equals_the_eager_encoder() -> None:
    from omnistage.pipeline.thinker.inputs import encode_media
    from test_multimodal_inputs import PromptProcessor, image, thinker_module, tiny_checkpoint, video

    thinker, processor = thinker_module("tiny"), PromptProcessor(tiny_checkpoint("tiny"))
    vision = VisionGraphRunner(thinker.visual, (32, 64), 4, torch.device("cpu"))
    content = [{"type": "image", "image": image(40)}, {"type": "image", "image": image(41, 96, 160)},
               {"type": "image", "image": image(42, 160, 160)}, {"type": "video", "video": video(7)},
               {"type": "text", "text": "and?"}]
    prompt = processor([{"role": "user", "content": content}])
    grids = prompt.image_grid_thw.tolist()
    assert [t * h * w for t, h, w in grids] == [24, 60, 100] and vision.groups(grids) == [[0], [1], [2]]
    assert not vision.fits(grids[2:]) and not vision.fits(prompt.video_grid_thw.tolist())  # these eagerly
    ours = encode_media(thinker, [prompt], torch.device("cpu"), torch.float32, None, vision)[0]
    ref = encode_media(thinker, [prompt], torch.device("cpu"), torch.float32)[0]
    assert ours[0] is None and ref[0] is None
    for a, b in zip(ours[1:], ref[1:]):
        for x, y in [(a.embeds, b.embeds), *zip(a.deepstack, b.deepstack)]:
            torch.testing.assert_close(x, y, rtol=0, atol=1e-5)
