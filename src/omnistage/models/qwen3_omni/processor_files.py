"""Tokenizer and processor files of a Qwen3-Omni model folder (what `AutoProcessor.from_pretrained` reads)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from omnistage.models.qwen3_omni.tokenizer import CHAT_TEMPLATE, tokenizer_json

PROCESSOR_CLASS = "Qwen3OmniMoeProcessor"
MODEL_MAX_LENGTH = 65536
# Tokenizer attributes the processor reads (`tokenizer.audio_token`, ...).
MULTIMODAL_TOKENS = dict(
    image_token="<|image_pad|>", audio_token="<|audio_pad|>", video_token="<|video_pad|>",
    vision_bos_token="<|vision_start|>", vision_eos_token="<|vision_end|>",
    audio_bos_token="<|audio_start|>", audio_eos_token="<|audio_end|>",
)
IMAGE_MEAN_STD = [0.5, 0.5, 0.5]


def tokenizer_config() -> dict[str, Any]:
    return dict(
        tokenizer_class="Qwen2Tokenizer", model_max_length=MODEL_MAX_LENGTH, bos_token=None,
        eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token=None, add_bos_token=False,
        add_prefix_space=False, clean_up_tokenization_spaces=False, split_special_tokens=False,
        errors="replace",
        extra_special_tokens=MULTIMODAL_TOKENS, processor_class=PROCESSOR_CLASS,
    )


def feature_extractor_config(audio: dict[str, Any]) -> dict[str, Any]:
    """WhisperFeatureExtractor: 128 log-mel bins at 16 kHz, 10 ms hop (100 frames per second)."""
    return dict(
        feature_extractor_type="WhisperFeatureExtractor", feature_size=audio["num_mel_bins"],
        sampling_rate=16000, hop_length=160, n_fft=400, chunk_length=300, n_samples=4_800_000,
        nb_max_frames=30_000, padding_side="right", padding_value=0.0, return_attention_mask=True, dither=0.0,
    )


def image_processor_config(vision: dict[str, Any], kind: str = "image") -> dict[str, Any]:
    """Qwen2-VL-style image/video processor matching the vision encoder's patching."""
    factor = (vision["patch_size"] * vision["spatial_merge_size"]) ** 2  # pixels per merged token
    return {
        f"{kind}_processor_type": "Qwen2VLImageProcessor" if kind == "image" else "Qwen2VLVideoProcessor",
        "patch_size": vision["patch_size"], "merge_size": vision["spatial_merge_size"],
        "temporal_patch_size": vision["temporal_patch_size"], "image_mean": IMAGE_MEAN_STD,
        "image_std": IMAGE_MEAN_STD, "size": {"shortest_edge": 64 * factor, "longest_edge": 16384 * factor},
        "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "do_resize": True,
        "do_convert_rgb": True, "processor_class": PROCESSOR_CLASS,
    }


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_processor_files(out_dir: Path, config: dict[str, Any]) -> None:
    """tokenizer.json (rebuilt Qwen BPE), tokenizer_config.json, chat_template.jinja, processor configs."""
    thinker = config["thinker_config"]
    shutil.copyfile(tokenizer_json(), out_dir / "tokenizer.json")
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config())
    (out_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    preprocessor = {**feature_extractor_config(thinker["audio_config"]),
                    **image_processor_config(thinker["vision_config"])}
    _write_json(out_dir / "preprocessor_config.json", preprocessor)
    video = image_processor_config(thinker["vision_config"], "video")
    _write_json(out_dir / "video_preprocessor_config.json", video)
    _write_json(out_dir / "processor_config.json", {"processor_class": PROCESSOR_CLASS})
