"""The audio tower on static buffers (`AudioGraphRunner`): padded runs equal the tower's forward (CPU: the same
function run eagerly; CUDA: the captured graphs, within bf16 rounding), runs grouped within their limits, and an
admission that uses them encodes as the eager path does."""

from __future__ import annotations

import pytest
import torch
from test_encoder_attention import AUDIO, seeded

from omnistage.models.qwen3_omni.audio_encoder import audio_forward
from omnistage.models.qwen3_omni.encoders import build_audio_tower
from omnistage.models.qwen3_omni.rope_index import audio_token_count
from omnistage.pipeline.thinker.audio_graph import AudioGraphRunner

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]


def _tower(device: str) -> torch.nn.Module:
    return seeded(build_audio_tower, AUDIO, device)


@pytest.mark.parametrize("device", DEVICES)
@torch.inference_mode()
def test_runs_equal_the_forward(device: str) -> None:
    tower = _tower(device)
    runner = AudioGraphRunner(tower, (1, 2, 4, 8, 16), torch.device(device))
    runner.capture()
    tol = {"rtol": 0, "atol": 1e-5} if device == "cpu" else {"rtol": 2e-2, "atol": 2e-2}
    # windows of 200 frames (AUDIO): 1234 frames span seven; 99 and 5 are a short chunk alone
    for seed, lens in enumerate([[240], [99], [100, 130], [1234], [801, 5, 300], [1], [1600]]):
        feats = torch.randn(128, sum(lens), generator=torch.Generator().manual_seed(seed))
        assert runner.fits(lens)
        ours = runner.run(feats, lens)  # host features, copied in
        ref = audio_forward(tower, feats.to(device, tower.conv2d1.weight.dtype), lens)
        assert ours.shape == ref.shape == (sum(audio_token_count(n, 50) for n in lens), AUDIO["output_dim"])
        torch.testing.assert_close(ours.float(), ref.float(), **tol)
    if device == "cuda":
        assert set(runner.graphs.graphs) == {1, 2, 4, 8, 16}  # all at start, none while running


def test_groups_keep_each_run_within_its_limits() -> None:
    runner = AudioGraphRunner(_tower("cpu"), (2, 4), torch.device("cpu"))
    lens = [150, 250, 100, 500, 1, 1]  # 2, 3, 1, 5, 1, 1 chunks
    runs = runner.groups(lens)
    assert runs == [[0], [1, 2], [3], [4, 5]]
    assert [runner.fits([lens[j] for j in r]) for r in runs] == [True, True, False, True]


@torch.no_grad()  # NOTE: not inference_mode: the tiny thinker is cached for later tests, which edit its weights
def test_admission_through_the_runner_equals_the_eager_encoder() -> None:
    from mm_samples import tone, video
    from test_multimodal_inputs import PromptProcessor, thinker_module, tiny_checkpoint

    from omnistage.pipeline.thinker.inputs import encode_media

    thinker, processor = thinker_module("tiny"), PromptProcessor(tiny_checkpoint("tiny"))
    audio = AudioGraphRunner(thinker.audio_tower, (2, 4), torch.device("cpu"))
    content = [{"type": "audio", "audio": tone(0.7)}, {"type": "audio", "audio": tone(2.3)},
               {"type": "audio", "audio": tone(6.0)}, {"type": "video", "video": video(7, audio_seconds=1.5)},
               {"type": "text", "text": "and?"}]
    prompt = processor([{"role": "user", "content": content}], use_audio_in_video=True)
    lens = list(prompt.audio_feature_lens)
    assert lens == [70, 230, 600, 150]  # 1, 3, 6 and 2 chunks
    assert audio.groups(lens) == [[0, 1], [2], [3]] and not audio.fits(lens[2:3])  # the 6 s clip eagerly
    ours = encode_media(thinker, [prompt], torch.device("cpu"), torch.float32, audio=audio)[0]
    ref = encode_media(thinker, [prompt], torch.device("cpu"), torch.float32)[0]
    assert ours[0].shape == ref[0].shape and ours[0].shape[0] == sum(audio_token_count(n, 50) for n in lens)
    torch.testing.assert_close(ours[0], ref[0], rtol=0, atol=1e-5)


def test_an_encoder_whose_graphs_fail_to_capture_runs_eagerly(caplog: pytest.LogCaptureFixture) -> None:
    from types import SimpleNamespace

    from omnistage.pipeline.placement.local import _capture_encoders

    class Broken:
        def capture(self) -> None:
            raise RuntimeError("operation not permitted when stream is capturing")

    captured = []
    vision = SimpleNamespace(capture=lambda: captured.append("vision"))
    stage = SimpleNamespace(vision=vision, audio=Broken())
    _capture_encoders(stage)
    assert stage.vision is vision and captured == ["vision"] and stage.audio is None
    assert "the audio encoder's CUDA graphs failed to capture" in caplog.text


@torch.no_grad()
def test_growing_prompts_pieces_through_the_runner_equal_them_alone() -> None:
    """A streamed turn's pieces (thinker/growth.py) arriving together are encoded in runs of the graphs; each
    piece's rows equal its own eager call's (what `extend` does without the runner)."""
    from test_multimodal_inputs import thinker_module

    from omnistage.pipeline.thinker.growth import PromptPiece, piece_rows

    thinker, cpu = thinker_module("tiny"), torch.device("cpu")
    audio = AudioGraphRunner(thinker.audio_tower, (2, 4, 8, 16), cpu)
    g = torch.Generator().manual_seed(0)
    window, tail = torch.randn(128, 800, generator=g), torch.randn(128, 950, generator=g)  # 8 and 10 chunks
    pieces = [PromptPiece(None, 0, [], window), PromptPiece(None, 0, [], None, closed=True),
              PromptPiece(None, 0, [], tail, skip=104)]
    ours = piece_rows(thinker, pieces, cpu, torch.float32, audio)
    assert ours[1] is None and piece_rows(thinker, pieces, cpu, torch.float32, None) == [None] * 3
    for piece, rows in [(pieces[0], ours[0]), (pieces[2], ours[2])]:
        ref = thinker.encode_audio(piece.audio[None], torch.ones(1, piece.audio.shape[1], dtype=torch.long))
        assert rows.shape == ref.shape == (audio_token_count(piece.audio.shape[1], 50), ref.shape[1])
        torch.testing.assert_close(rows, ref, rtol=0, atol=1e-5)
