"""Audio ("AuT") and vision encoders of the thinker: transformers' classes and weights, run by our forwards
(`audio_encoder.py`, `vision_encoder.py`: indices from the host, packed attention).

`encode_audio` / `encode_visual` return rows ready to be scattered into the placeholder positions
(`<|audio_pad|>`, `<|image_pad|>`, `<|video_pad|>`) in prompt order.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch import nn
from transformers import PreTrainedConfig
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import (
    Qwen3OmniMoeAudioEncoderConfig,
    Qwen3OmniMoeVisionEncoderConfig,
)
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeAudioEncoder,
    Qwen3OmniMoeVisionEncoder,
)

from omnistage.models.qwen3_omni.audio_encoder import audio_forward
from omnistage.models.qwen3_omni.vision_encoder import vision_forward


class VisualEmbeds(NamedTuple):
    """Merged patch rows `[N, H]` (one per placeholder token) and one `[N, H]` DeepStack tensor per level."""

    embeds: torch.Tensor
    deepstack: list[torch.Tensor]


def build_audio_tower(audio_config: PreTrainedConfig | Mapping[str, Any]) -> nn.Module:
    if not isinstance(audio_config, PreTrainedConfig):
        audio_config = Qwen3OmniMoeAudioEncoderConfig(**audio_config)
    return Qwen3OmniMoeAudioEncoder(audio_config)


def build_visual(vision_config: PreTrainedConfig | Mapping[str, Any]) -> nn.Module:
    if not isinstance(vision_config, PreTrainedConfig):
        vision_config = Qwen3OmniMoeVisionEncoderConfig(**vision_config)
    return Qwen3OmniMoeVisionEncoder(vision_config)


def encode_audio(audio_tower: nn.Module, input_features: torch.Tensor,
                 feature_attention_mask: torch.Tensor) -> torch.Tensor:
    """Log-mel features `[B, mels, frames]` with their prefix mask `[B, frames]` (on the host: no sync) -> audio
    token rows `[N, H]` (all audios concatenated; N = sum of `_get_feat_extract_output_lengths(mask.sum(-1))`)."""
    lens = feature_attention_mask.sum(dim=1).tolist()
    feats = torch.cat([f[:, :n] for f, n in zip(input_features, lens)], dim=1)
    return audio_forward(audio_tower, feats, lens)


def encode_visual(visual: nn.Module, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> VisualEmbeds:
    """Patches `[num_patches, C * T * P * P]` of images (or videos) with `grid_thw [num, 3]` (on the host: no
    sync)."""
    embeds, deepstack = vision_forward(visual, pixel_values.to(visual.dtype), grid_thw.tolist())
    return VisualEmbeds(embeds, deepstack)
