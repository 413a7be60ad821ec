"""Qwen3-Omni thinker: audio / vision encoders + MoE text decoder + lm_head, on flat token batches."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

from omnistage.models.qwen3_omni.decoder import DecoderConfig, DecoderModel, Deepstack
from omnistage.models.qwen3_omni.encoders import (
    VisualEmbeds,
    build_audio_tower,
    build_visual,
    encode_audio,
    encode_visual,
)


class ThinkerOutput(NamedTuple):
    hidden_states: torch.Tensor  # [T, H] after the final norm (feed to compute_logits)
    accept_hidden: torch.Tensor | None  # [T, H] transformers' hidden_states[accept_hidden_layer]
    inputs_embeds: torch.Tensor  # [T, H] transformers' hidden_states[0] (encoder rows scattered in)


class ThinkerTextModel(DecoderModel):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__(cfg)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)


def _as_dict(config: Any) -> dict[str, Any]:
    return config.to_dict() if hasattr(config, "to_dict") else dict(config)


class Thinker(nn.Module):
    def __init__(self, thinker_config: Any) -> None:
        """`thinker_config`: transformers' `Qwen3OmniMoeThinkerConfig` or its `config.json` dict."""
        super().__init__()
        d = _as_dict(thinker_config)
        text = DecoderConfig.from_dict(d["text_config"])
        self.model = ThinkerTextModel(text)
        self.lm_head = nn.Linear(text.hidden_size, text.vocab_size, bias=False)
        self.audio_tower = build_audio_tower(d["audio_config"])
        self.visual = build_visual(d["vision_config"])
        self.audio_token_id = d["audio_token_id"]
        self.image_token_id = d["image_token_id"]
        self.video_token_id = d["video_token_id"]

    def encode_audio(self, input_features: torch.Tensor, feature_attention_mask: torch.Tensor) -> torch.Tensor:
        return encode_audio(self.audio_tower, input_features, feature_attention_mask)

    def encode_visual(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> VisualEmbeds:
        return encode_visual(self.visual, pixel_values, grid_thw)

    def embed(self, input_ids: torch.Tensor, audio_embeds: torch.Tensor | None = None,
              image: VisualEmbeds | None = None, video: VisualEmbeds | None = None,
              host_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, Deepstack | None]:
        """Token embeddings with encoder rows scattered into the placeholder positions (in order).
        `host_ids`: the same ids on the host, where the positions are found without a device sync."""
        ids = input_ids if host_ids is None else host_ids
        embeds = self.model.embed_tokens(input_ids)
        if audio_embeds is not None:
            embeds = _scatter(embeds, ids == self.audio_token_id, audio_embeds)
        parts = [(ids == tok, v) for tok, v in ((self.image_token_id, image), (self.video_token_id, video))
                 if v is not None]
        if not parts:
            return embeds, None
        for mask, v in parts:
            embeds = _scatter(embeds, mask, v.embeds)
        visual_mask = parts[0][0] if len(parts) == 1 else parts[0][0] | parts[1][0]
        index = visual_mask.nonzero().squeeze(1)
        levels = []
        for level in range(len(parts[0][1].deepstack)):
            joint = embeds.new_zeros(index.shape[0], embeds.shape[1])
            for mask, v in parts:
                joint = _scatter(joint, mask[index], v.deepstack[level])
            levels.append(joint)
        return embeds, Deepstack(index.to(embeds.device, non_blocking=True), levels)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, audio_embeds: torch.Tensor | None = None,
                image: VisualEmbeds | None = None, video: VisualEmbeds | None = None,
                accept_hidden_layer: int | None = None) -> ThinkerOutput:
        """Flat `input_ids [T]`, `positions [T]` or `[3, T]`; runs inside a `forward_context`."""
        embeds, deepstack = self.embed(input_ids, audio_embeds, image, video)
        hidden, accept = self.model(embeds, positions, accept_hidden_layer, deepstack)
        return ThinkerOutput(hidden, accept, embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)


def _scatter(embeds: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """`rows` into the rows of `embeds` where `mask`, in order."""
    # NOTE: a mask on the device syncs here (its positions); one on the host (`embed`'s host_ids) does not.
    index = mask.nonzero().squeeze(1)
    if index.shape[0] != rows.shape[0]:
        raise ValueError(f"{index.shape[0]} placeholder tokens but {rows.shape[0]} encoder rows")
    return embeds.index_copy(0, index.to(embeds.device, non_blocking=True), rows.to(embeds.dtype))
