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
    """Wraps the checkpoint's `AutoProcessor` (tokenizer, chat template, feature extractor)."""

    def __init__(self, model_dir: str | Path) -> None:
        from transformers import AutoProcessor

        self.processor = AutoProcessor.from_pretrained(str(model_dir))
        self.tokenizer = self.processor.tokenizer

    def __call__(self, messages: list[dict[str, Any]], allowed_local_dir: str | None = None) -> PromptInputs:
        conversation, audios = to_conversation(messages, allowed_local_dir)
        text = self.processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        if not audios:
            return PromptInputs(input_ids=self.tokenizer(text)["input_ids"])
        batch = self.processor(text=[text], audio=audios, return_tensors="pt", padding=True)
        return PromptInputs(input_ids=batch["input_ids"][0].tolist(), input_features=batch["input_features"],
                            feature_attention_mask=batch["feature_attention_mask"])

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)
