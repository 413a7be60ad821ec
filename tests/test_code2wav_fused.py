"""Code2Wav's fused decoder path (`code2wav_fused`, CUDA's fast path) against the reference path, on the GPU or, here,
in Triton's interpreter (fast path forced on for CPU tensors): one-shot, and a batched stream of first and later
chunks whose samples and saved state equal the reference's."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

import pytest
import torch
from transformers import Qwen3OmniMoeConfig

from omnistage.layers import triton_ops
from omnistage.models.qwen3_omni import code2wav_fused
from omnistage.models.qwen3_omni.code2wav_conv import DecoderResidualUnit
from omnistage.models.qwen3_omni.code2wav_stream import Code2WavStreamer
from omnistage.models.qwen3_omni.model import build_stage
from omnistage.models.qwen3_omni.presets import preset_config

from conftest import KERNEL_DEVICE as DEV

pytestmark = pytest.mark.skipif(triton_ops.triton is None, reason="needs Triton")


@contextlib.contextmanager
def fast_path(on: bool) -> Iterator[None]:
    # NOTE: fp32 without TF32, so that the reference convs on a GPU round as finely as the interpreter's
    with mock.patch.object(triton_ops, "fast_path", lambda x: on), torch.backends.cudnn.flags(allow_tf32=False):
        yield


def _stream(model: torch.nn.Module, codes: torch.Tensor, schedule: list[int]) -> tuple[torch.Tensor, list]:
    """Every row of `codes [B, Q, N]` as one stream, all stepped together; (samples [B, S], the cache's tensors)."""
    streamer = Code2WavStreamer(model, max_streams=codes.shape[0] + 1)
    streamer.open()  # NOTE: slot 0 unused, so the rows' slots differ from their batch rows
    states, chunks, start = [streamer.open() for _ in codes], [], 0
    for n in schedule:
        chunks.append(torch.stack(streamer.step([(s, c[:, start:start + n]) for s, c in zip(states, codes)])))
        start += n
    return torch.cat(chunks, dim=1), [streamer.cache.pos, *streamer.cache.states.values()]


@pytest.mark.parametrize(("preset", "direct"), [("tiny", False), ("tiny-wide", False), ("tiny", True)])
@torch.no_grad()
def test_fused_decoder_equals_reference(preset: str, direct: bool) -> None:
    """`direct`: every residual conv as `triton_conv.conv1d` (the full-size model takes it at some shapes)."""
    model = build_stage(Qwen3OmniMoeConfig(**preset_config(preset)), "code2wav", load_format="dummy", device=DEV,
                        dtype="float32", seed=3)
    codes = torch.randint(0, 2048, (2, 16, 3), generator=torch.Generator().manual_seed(0)).to(DEV)
    runs = {}
    for on in (False, True):
        with fast_path(on), mock.patch.object(code2wav_fused, "direct", lambda layer, h: direct):
            runs[on] = (model(codes)[:, 0], *_stream(model, codes, [2, 1]))
    (ref, ref_stream, ref_state), (fused, stream, state) = runs[False], runs[True]
    assert stream.shape == fused.shape == ref.shape == (2, 3 * 1920 - 555)
    scale = float(ref.abs().max())
    assert scale > 0.05  # a signal, not silence (dummy weights: ~0.3)
    assert float((fused - ref).abs().max()) <= 1e-5 * scale  # measured: ~6e-7 relative
    assert float((stream - ref_stream).abs().max()) <= 1e-5 * scale
    assert float((stream - fused).abs().max()) <= 1e-5 * scale
    for a, b in zip(state, ref_state, strict=True):
        assert float((a - b).abs().max()) <= 1e-5 * float(b.abs().max().clamp(min=1))


def test_direct_convs_by_shape() -> None:
    """The full-size 384-channel dilation-9 conv of a 25-frame chunk: Triton at batch 16, cuDNN at batch 4 and for
    other channels, kernels or lengths."""
    unit = DecoderResidualUnit(384, 9)
    h = torch.empty(16, 384, 4000 + 54, device="meta")
    assert unit.conv1.context == 54 and code2wav_fused.direct(unit.conv1, h)
    assert not code2wav_fused.direct(unit.conv1, h[:4])
    assert not code2wav_fused.direct(unit.conv1, h[..., 1:])
    assert not code2wav_fused.direct(unit.conv2, torch.empty(16, 384, 4000, device="meta"))
    assert not code2wav_fused.direct(DecoderResidualUnit(384, 1).conv1, h[..., 48:])
