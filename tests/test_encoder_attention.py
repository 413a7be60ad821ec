"""The encoders' forwards (`audio_encoder`, `vision_encoder`: host indices, packed attention) against
transformers' own encoders with `sdpa`: exact on the CPU (the reference path), within bf16 rounding on CUDA
(one flash call per layer, no host sync)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import (
    Qwen3OmniMoeAudioEncoderConfig,
    Qwen3OmniMoeVisionEncoderConfig,
)
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeAudioEncoder,
    Qwen3OmniMoeVisionEncoder,
)

from omnistage.models.qwen3_omni.encoders import build_audio_tower, build_visual, encode_audio, encode_visual
from omnistage.models.qwen3_omni.rope_index import audio_token_count

# head dims as the full-size encoders (audio 1280 / 20, vision 1152 / 16); windows of 200 mel frames, so a
# 15 s audio spans several
AUDIO = dict(num_mel_bins=128, d_model=256, encoder_layers=3, encoder_attention_heads=4, encoder_ffn_dim=512,
             downsample_hidden_size=32, output_dim=64, n_window=50, n_window_infer=200, conv_chunksize=500,
             max_source_positions=1500)
VISION = dict(depth=4, hidden_size=288, intermediate_size=576, num_heads=4, in_channels=3, patch_size=16,
              spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=2304,
              deepstack_visual_indexes=[1, 2, 3])


def seeded(build, config: dict, device: str) -> torch.nn.Module:
    """`build(config)` on `device` with seed 0, in float32 on the CPU and bfloat16 elsewhere, eval mode."""
    torch.manual_seed(0)
    with torch.device(device):
        module = build(config)
    return module.to(torch.float32 if device == "cpu" else torch.bfloat16).eval()


def _pair(device: str, dtype: torch.dtype):
    torch.manual_seed(0)
    with torch.device(device):
        audio, visual = build_audio_tower(AUDIO), build_visual(VISION)
        ref_audio = Qwen3OmniMoeAudioEncoder(Qwen3OmniMoeAudioEncoderConfig(**AUDIO))
        ref_visual = Qwen3OmniMoeVisionEncoder(Qwen3OmniMoeVisionEncoderConfig(**VISION))
    ref_audio.load_state_dict(audio.state_dict())
    ref_visual.load_state_dict(visual.state_dict())
    assert ref_audio.config._attn_implementation == ref_visual.config._attn_implementation == "sdpa"
    return [m.to(dtype).eval() for m in (audio, visual, ref_audio, ref_visual)]


def _inputs(device: str, dtype: torch.dtype):
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(3, 128, 1500, generator=g)
    mask = torch.ones(3, 1500, dtype=torch.long)
    mask[1, 730:] = 0  # 15 s, 7.3 s and 0.37 s: several windows, short last chunks, a clip of one short chunk
    mask[2, 37:] = 0
    grid = torch.tensor([[1, 8, 12], [1, 6, 6], [4, 6, 8]])  # two images and a 4-step video
    pixels = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 16 * 16, generator=g)
    return feats.to(device, dtype), mask, pixels.to(device, dtype), grid


@torch.inference_mode()
def _outputs(device: str, dtype: torch.dtype):
    audio, visual, ref_audio, ref_visual = _pair(device, dtype)
    feats, mask, pixels, grid = _inputs(device, dtype)
    ours = [encode_audio(audio, feats, mask), *_flat(encode_visual(visual, pixels, grid))]
    flat = feats.permute(0, 2, 1)[mask.to(device).bool()].permute(1, 0)
    out = ref_visual(pixels, grid_thw=grid.to(device))
    ref = [ref_audio(flat, feature_lens=mask.to(device).sum(1)).last_hidden_state, out.pooler_output,
           *out.deepstack_features]
    return ours, ref


def _flat(v):
    return [v.embeds, *v.deepstack]


def test_packed_attention_is_transformers_sdpa_on_the_cpu():
    ours, ref = _outputs("cpu", torch.float32)
    assert ours[0].shape == (sum(audio_token_count(n, 50) for n in (1500, 730, 37)), 64)
    assert ours[1].shape == (int(torch.tensor([96, 36, 192]).sum()) // 4, 64)
    for a, b in zip(ours, ref):
        assert torch.equal(a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the flash path is CUDA's")
def test_packed_attention_flash_within_bf16_on_cuda():
    ours, ref = _outputs("cuda", torch.bfloat16)
    for a, b in zip(ours, ref):
        rel = float((a.float() - b.float()).norm() / b.float().norm())
        assert rel < 1e-2, rel


@pytest.mark.parametrize("frames", [1, 99, 100, 101, 799, 800, 801, 1234, 3000])
def test_audio_layout_is_transformers(frames):
    from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as hf

    from omnistage.models.qwen3_omni.audio_encoder import audio_layout

    if not hasattr(hf, "get_audio_cu_seqlens"):
        pytest.skip("this transformers computes the layout inside the forward (the parity test above covers it)")
    lens = torch.tensor([frames, 130])
    chunks, valid, windows = audio_layout(lens.tolist(), 50, 800)
    ref_chunks = hf.chunk_and_pad_features(torch.zeros(1, int(lens.sum())), lens, 50)[1]
    assert chunks == ref_chunks.tolist()
    assert valid == hf.get_valid_indices(ref_chunks, 50).tolist()
    cu = hf.get_audio_cu_seqlens(ref_chunks, lens, 800, 50)
    assert windows == (cu[1:] - cu[:-1]).tolist()
