"""The prompt pieces around a streamed audio (pipeline/prompt_stream.py): the messages with it appended, the
prompt before its placeholders (sent at open), and the conv chunk width the audio tower pads a call to."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np

from omnistage.models.qwen3_omni.media_keys import media_keys
from omnistage.models.qwen3_omni.prompt import PromptInputs, PromptProcessor
from omnistage.models.qwen3_omni.rope_index import audio_token_count

Messages = list[dict[str, Any]]


def with_audio(messages: Messages, audio: np.ndarray) -> Messages:
    """`messages` with `audio` appended as the last content part of the last (user) message."""
    if not messages or messages[-1].get("role") != "user":
        raise ValueError("messages: a streamed audio needs a user message last")
    last = dict(messages[-1])
    content = last.get("content", [])
    parts = [{"type": "text", "text": content}] if isinstance(content, str) else list(content)
    last["content"] = [*parts, {"type": "audio", "audio": audio}]
    return [*messages[:-1], last]


def chunk_width(lens: list[int], chunk: int) -> int:
    """The width the audio tower pads every conv chunk of one call to (its longest chunk)."""
    return max(min(n, chunk) for n in lens)


def prefix_prompt(processor: PromptProcessor, prompt: PromptInputs) -> PromptInputs | None:
    """The part of `prompt` (made with a stand-in for the streamed audio, its last) before the streamed
    audio's placeholders; None when it has images or videos (3-D positions: the prompt is sent whole)."""
    if prompt.image_grid_thw is not None or prompt.video_grid_thw is not None:
        return None
    pad = processor.tokenizer.convert_tokens_to_ids("<|audio_pad|>")
    count = audio_token_count(prompt.audio_feature_lens[-1], processor.n_window)
    ids = prompt.input_ids
    cut = len(ids) - ids[::-1].index(pad) - count
    out = copy.copy(prompt)
    out.input_ids = ids[:cut]
    out.input_features, out.feature_attention_mask = (
        (None, None) if len(prompt.audio_feature_lens) == 1
        else (prompt.input_features[:-1], prompt.feature_attention_mask[:-1]))
    out.media_keys = media_keys(out, processor.pad_ids, (), ())  # the earlier audios': its prefix can be cached
    return out
