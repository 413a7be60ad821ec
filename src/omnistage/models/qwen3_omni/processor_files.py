"""Tokenizer and processor files of a Qwen3-Omni model folder: writing the real repo's set, and finding the
chat template wherever a folder keeps it.

The real `Qwen/Qwen3-Omni-30B-A3B-Instruct` (also -Thinking, -Captioner) ships vocab.json + merges.txt, a
tokenizer_config.json without a template, the template in chat_template.json (the processor's legacy file) and
one preprocessor_config.json for the WhisperFeatureExtractor and the Qwen2-VL image processor; no
tokenizer.json, chat_template.jinja, processor_config.json or video_preprocessor_config.json.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omnistage.models.qwen3_omni.tokenizer import (
    CHAT_TEMPLATE,
    TEXT_LIKE_TOKENS,
    special_token_ids,
    tokenizer_json,
)

PROCESSOR_CLASS = "Qwen3OmniMoeProcessor"
MODEL_MAX_LENGTH = 65536
# Tokenizer attributes the processor reads (`tokenizer.audio_token`, ...).
MULTIMODAL_TOKENS = dict(
    image_token="<|image_pad|>", audio_token="<|audio_pad|>", video_token="<|video_pad|>",
    vision_bos_token="<|vision_start|>", vision_eos_token="<|vision_end|>",
    audio_bos_token="<|audio_start|>", audio_eos_token="<|audio_end|>",
)
IMAGE_MEAN_STD = [0.5, 0.5, 0.5]
# Where a folder may keep its chat template, in the order transformers' processor looks (chat_template.json
# before chat_template.jinja), then the tokenizer's own key; (file name, JSON key or None for a raw file).
CHAT_TEMPLATE_PLACES = (("chat_template.json", "chat_template"), ("chat_template.jinja", None),
                        ("tokenizer_config.json", "chat_template"))


def tokenizer_config() -> dict[str, Any]:
    """Qwen2Tokenizer over vocab.json + merges.txt; the special tokens as `added_tokens_decoder` entries."""
    added = {str(i): dict(content=name, lstrip=False, normalized=False, rstrip=False, single_word=False,
                          special=name not in TEXT_LIKE_TOKENS) for name, i in special_token_ids().items()}
    return dict(
        tokenizer_class="Qwen2Tokenizer", model_max_length=MODEL_MAX_LENGTH, bos_token=None,
        eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token=None, add_bos_token=False,
        add_prefix_space=False, clean_up_tokenization_spaces=False, split_special_tokens=False,
        errors="replace", added_tokens_decoder=added,
        extra_special_tokens=MULTIMODAL_TOKENS, processor_class=PROCESSOR_CLASS,
    )


def preprocessor_config(thinker: dict[str, Any]) -> dict[str, Any]:
    """The real repo's preprocessor_config.json: WhisperFeatureExtractor (128 log-mel bins at 16 kHz, 10 ms
    hop) and the Qwen2-VL image processor (min_pixels 3136, max_pixels 12845056), patching as the vision
    config."""
    audio, vision = thinker["audio_config"], thinker["vision_config"]
    return dict(
        feature_extractor_type="WhisperFeatureExtractor", feature_size=audio["num_mel_bins"],
        sampling_rate=16000, hop_length=160, n_fft=400, chunk_length=300, n_samples=4_800_000,
        nb_max_frames=30_000, padding_side="right", padding_value=0.0, return_attention_mask=True, dither=0.0,
        image_processor_type="Qwen2VLImageProcessor", patch_size=vision["patch_size"],
        temporal_patch_size=vision["temporal_patch_size"], merge_size=vision["spatial_merge_size"],
        min_pixels=3136, max_pixels=12_845_056, image_mean=IMAGE_MEAN_STD, image_std=IMAGE_MEAN_STD,
        processor_class=PROCESSOR_CLASS,
    )


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_processor_files(out_dir: Path, config: dict[str, Any]) -> None:
    """vocab.json + merges.txt (rebuilt Qwen BPE), tokenizer_config.json, chat_template.json and
    preprocessor_config.json: the real repo's side files."""
    from tokenizers import Tokenizer

    Tokenizer.from_file(str(tokenizer_json())).model.save(str(out_dir))
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config())
    _write_json(out_dir / "chat_template.json", {"chat_template": CHAT_TEMPLATE})
    _write_json(out_dir / "preprocessor_config.json", preprocessor_config(config["thinker_config"]))


def find_chat_template(model_dir: str | Path) -> str:
    """The folder's chat template from the first of `CHAT_TEMPLATE_PLACES` that holds one."""
    for name, key in CHAT_TEMPLATE_PLACES:
        path = Path(model_dir) / name
        if not path.is_file():
            continue
        text = path.read_text(encoding="utf-8")
        template = text if key is None else json.loads(text).get(key)
        if template:
            return template
    places = ", ".join(name for name, _ in CHAT_TEMPLATE_PLACES)
    raise FileNotFoundError(f"{model_dir} has no chat template (looked in {places})")


def load_tokenizer(model_dir: str | Path):
    """`AutoTokenizer` (tokenizer.json, or vocab.json + merges.txt) with the folder's chat template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    tokenizer.chat_template = find_chat_template(model_dir)
    return tokenizer
