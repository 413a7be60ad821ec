"""OpenAI-format chat messages -> thinker prompt ids and encoder features, through the checkpoint's processor."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from omnistage.media import MediaError, audio_from_url, b64decode, decode_audio_bytes


@dataclass
class PromptInputs:
    input_ids: list[int]
    input_features: torch.Tensor | None = None  # [num_audios, mel_bins, frames]
    feature_attention_mask: torch.Tensor | None = None  # [num_audios, frames]


def _part(part: Any, audios: list[np.ndarray], allowed_local_dir: str | None) -> dict[str, Any]:
    if isinstance(part, str):
        return {"type": "text", "text": part}
    kind = part.get("type")
    if kind == "text":
        return {"type": "text", "text": part.get("text", "")}
    if kind == "input_audio":
        audios.append(decode_audio_bytes(b64decode(part["input_audio"]["data"])))
    elif kind == "audio_url":
        audios.append(audio_from_url(part["audio_url"]["url"], allowed_local_dir))
    elif kind == "audio":
        value = part["audio"]
        audios.append(np.asarray(value, np.float32) if not isinstance(value, str)
                      else audio_from_url(value, allowed_local_dir))
    else:
        raise MediaError(f"unsupported content part type {kind!r}")
    return {"type": "audio", "audio": audios[-1]}


def to_conversation(messages: list[dict[str, Any]], allowed_local_dir: str | None = None
                    ) -> tuple[list[dict[str, Any]], list[np.ndarray]]:
    """Messages with string or parts content -> the processor's conversation format, plus the audios in order."""
    audios: list[np.ndarray] = []
    conversation = []
    for m in messages:
        content = m.get("content") or ""
        parts = [content] if isinstance(content, str) else content
        conversation.append({"role": m["role"], "content": [_part(p, audios, allowed_local_dir) for p in parts]})
    return conversation, audios


class PromptProcessor:
    """The checkpoint's tokenizer (with its chat template) and audio feature extractor. Audio
    placeholders expand like transformers' Qwen3OmniMoeProcessor (which would also need torchvision)."""

    AUDIO_PAD = "<|audio_pad|>"

    def __init__(self, model_dir: str | Path) -> None:
        from transformers import AutoTokenizer, WhisperFeatureExtractor

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.feature_extractor = WhisperFeatureExtractor.from_pretrained(str(model_dir))

    def __call__(self, messages: list[dict[str, Any]], allowed_local_dir: str | None = None) -> PromptInputs:
        from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import _get_feat_extract_output_lengths

        conversation, audios = to_conversation(messages, allowed_local_dir)
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
