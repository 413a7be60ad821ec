"""OpenAI-format chat messages -> thinker prompt ids and encoder features, through the checkpoint's processor."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from omnistage.media import MediaError, MediaPolicy, to_conversation


@dataclass
class PromptInputs:
    input_ids: list[int]
    input_features: torch.Tensor | None = None  # [num_audios, mel_bins, frames]
    feature_attention_mask: torch.Tensor | None = None  # [num_audios, frames]


class PromptProcessor:
    """The checkpoint's tokenizer (with its chat template) and audio feature extractor. Audio
    placeholders expand like transformers' Qwen3OmniMoeProcessor (which would also need torchvision)."""

    AUDIO_PAD = "<|audio_pad|>"

    def __init__(self, model_dir: str | Path, media_policy: MediaPolicy | None = None) -> None:
        from transformers import AutoTokenizer, WhisperFeatureExtractor

        self.media_policy = media_policy or MediaPolicy()
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.feature_extractor = WhisperFeatureExtractor.from_pretrained(str(model_dir))

    def __call__(self, messages: list[dict[str, Any]]) -> PromptInputs:
        from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import _get_feat_extract_output_lengths

        media = to_conversation(messages, self.media_policy)
        conversation, audios = media.conversation, media.audios
        text = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        if not audios:
            return PromptInputs(input_ids=self.tokenizer(text)["input_ids"])
        feats = self.feature_extractor(audios, sampling_rate=16000, padding=True, truncation=False,
                                       return_attention_mask=True, return_tensors="pt")
        counts = _get_feat_extract_output_lengths(feats["attention_mask"].sum(-1)).tolist()
        pieces = text.split(self.AUDIO_PAD)
        if len(pieces) != len(counts) + 1:
            raise MediaError(f"{len(pieces) - 1} audio placeholders in the prompt for {len(counts)} audios")
        text = pieces[0] + "".join(self.AUDIO_PAD * n + rest for n, rest in zip(counts, pieces[1:]))
        return PromptInputs(input_ids=self.tokenizer(text)["input_ids"], input_features=feats["input_features"],
                            feature_attention_mask=feats["attention_mask"])

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)
