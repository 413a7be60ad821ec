"""Chat messages -> thinker prompt ids and encoder inputs, through the checkpoint's processor pieces.

transformers' `Qwen3OmniMoeProcessor` cannot be built without torchvision (its video processor imports
it), so its pieces are used directly: the tokenizer with the folder's chat template (`load_tokenizer`),
the WhisperFeatureExtractor, and the image processor for images and video frames (`visual_processing.py`).
Placeholders expand as the processor expands them (audio-in-video interleaving included).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from omnistage.media import MediaError, MediaItems, MediaPolicy, to_conversation
from omnistage.models.qwen3_omni.feature_cache import FeatureCache
from omnistage.models.qwen3_omni.media_keys import MediaKeys, media_keys, source_key
from omnistage.models.qwen3_omni.processor_files import load_tokenizer
from omnistage.models.qwen3_omni.rope_index import audio_token_count, merge_ranks
from omnistage.models.qwen3_omni.visual_processing import VisualProcessor

_PADS = ("<|audio_pad|>", "<|image_pad|>", "<|video_pad|>")
FEATURE_CACHE_BYTES = 64 << 20  # ~250 clips of 5 s (a 5 s clip: 128 x 500 float32)


@dataclass
class PromptInputs:
    input_ids: list[int]
    input_features: torch.Tensor | None = None  # [num_audios, mel_bins, frames], audios in prompt order
    feature_attention_mask: torch.Tensor | None = None  # [num_audios, frames]
    pixel_values: torch.Tensor | None = None  # [patches, C * T * P * P] of all images (float32 or `patch_dtype`)
    image_grid_thw: torch.Tensor | None = None  # [num_images, 3]
    pixel_values_videos: torch.Tensor | None = None  # [patches, C * T * P * P] of all videos
    video_grid_thw: torch.Tensor | None = None  # [num_videos, 3]
    video_second_per_grid: torch.Tensor | None = None  # [num_videos] float32: temporal_patch_size / fps
    use_audio_in_video: bool = False
    media_keys: MediaKeys | None = None  # None: no cache may reuse its rows

    @property
    def audio_feature_lens(self) -> list[int]:
        m = self.feature_attention_mask
        return [] if m is None else m.sum(-1).tolist()


class PromptProcessor:
    def __init__(self, model_dir: str | Path, media_policy: MediaPolicy | None = None,
                 limits: dict[str, dict[str, int]] | None = None, patch_dtype: torch.dtype = torch.float32) -> None:
        """`limits`: the deploy's `mm_processor_kwargs` (visual_processing.within); `patch_dtype`: the images' and
        videos' patches' (the vision encoder's dtype: half the bytes in bfloat16, the same values it would cast)."""
        from transformers import WhisperFeatureExtractor

        self.media_policy = media_policy or MediaPolicy()
        self.tokenizer = load_tokenizer(model_dir)
        self.feature_extractor = WhisperFeatureExtractor.from_pretrained(str(model_dir))
        self.visual = VisualProcessor(str(model_dir), limits, patch_dtype)
        self.feature_cache = FeatureCache(FEATURE_CACHE_BYTES)
        thinker = json.loads((Path(model_dir) / "config.json").read_text())["thinker_config"]
        self.n_window = thinker.get("audio_config", {}).get("n_window", 50)
        self.n_window_infer = thinker.get("audio_config", {}).get("n_window_infer", 800)  # mel frames
        self.position_id_per_seconds = thinker.get("position_id_per_seconds", 13)
        self.pad_ids = tuple(self.tokenizer.convert_tokens_to_ids(list(_PADS)))

    def __call__(self, messages: list[dict[str, Any]], use_audio_in_video: bool = False) -> PromptInputs:
        """Decode the messages' media (under the processor's media policy) and process them."""
        return self.process(to_conversation(messages, self.media_policy, use_audio_in_video))

    def process(self, items: MediaItems) -> PromptInputs:
        """Decoded media (`to_conversation`'s): audios in prompt order (with `use_audio_in_video` a
        video's track at its video), images (PIL) and videos (`frames` [T, H, W, 3] uint8 at `fps`) with
        their options (min_pixels, max_pixels, total_pixels for videos, resized_height with resized_width)."""
        use_audio_in_video = items.use_audio_in_video
        text = self.tokenizer.apply_chat_template(items.conversation, add_generation_prompt=True, tokenize=False)
        found = re.findall("|".join(map(re.escape, _PADS)), text)
        want = (len(items.audios) - sum(use_audio_in_video and v.audio is not None for v in items.videos),
                len(items.images), len(items.videos))
        if tuple(found.count(p) for p in _PADS) != want:
            raise MediaError(f"the prompt has {[found.count(p) for p in _PADS]} audio/image/video placeholders "
                             f"for {list(want)} items")
        out = PromptInputs([], use_audio_in_video=use_audio_in_video)
        counts = self._audio(items.audios, out)
        image_tokens = self._images(items.images, items.image_options, out)
        videos = self._videos(items.videos, items.video_options, out)
        audio_at, image_at, video_at = iter(counts), iter(image_tokens), iter(videos)
        expanded = []
        for piece in re.split("(" + "|".join(map(re.escape, _PADS)) + ")", text):
            if piece == _PADS[0]:
                piece *= next(audio_at)
            elif piece == _PADS[1]:
                piece *= next(image_at)
            elif piece == _PADS[2]:
                video = next(video_at)
                piece = self._interleaved(video, next(audio_at)) if use_audio_in_video and video[3] else (
                    piece * video[0])
            expanded.append(piece)
        out.input_ids = self.tokenizer("".join(expanded))["input_ids"]
        out.media_keys = media_keys(out, self.pad_ids, tuple(
            source_key("image", np.asarray(im), o) for im, o in zip(items.images, items.image_options)), tuple(
            source_key("video", v.frames, o) for v, o in zip(items.videos, items.video_options)))
        return out

    def audio_features(self, audios: list[np.ndarray], cache: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """16 kHz clips -> log-mel features `[n, mels, frames]` (padded to the longest) and their mask; those
        made before at the same padded length from `feature_cache` (`cache`)."""
        if cache:
            return self.feature_cache.features(audios, self._clip_features)
        feats = self.feature_extractor(audios, sampling_rate=16000, padding=True, truncation=False,
                                       return_attention_mask=True, return_tensors="pt")
        return feats["input_features"], feats["attention_mask"]

    def _clip_features(self, clip: np.ndarray, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        feats = self.feature_extractor([clip], sampling_rate=16000, padding="max_length", max_length=length,
                                       truncation=False, return_attention_mask=True, return_tensors="pt")
        return feats["input_features"][0], feats["attention_mask"][0]

    def _audio(self, audios: list[np.ndarray], out: PromptInputs) -> list[int]:
        if not audios:
            return []
        out.input_features, out.feature_attention_mask = self.audio_features(audios)
        return [audio_token_count(n, self.n_window) for n in out.audio_feature_lens]

    def _images(self, images: list[Any], options: list[dict[str, Any]], out: PromptInputs) -> list[int]:
        if not images:
            return []
        out.pixel_values, out.image_grid_thw = self.visual.images(images, options)
        return (out.image_grid_thw.prod(-1) // self.visual.merge_size**2).tolist()

    def _videos(self, videos: list[Any], options: list[dict[str, Any]], out: PromptInputs
                ) -> list[tuple[int, list[int], float, bool]]:
        """Each video's (token count, grid, seconds per grid, has an audio track)."""
        if not videos:
            return []
        out.pixel_values_videos, out.video_grid_thw, seconds = self.visual.videos(videos, options)
        out.video_second_per_grid = torch.tensor(seconds, dtype=torch.float32)
        tokens = (out.video_grid_thw.prod(-1) // self.visual.merge_size**2).tolist()
        return [(n, g, s, v.audio is not None) for n, g, s, v in zip(tokens, out.video_grid_thw.tolist(), seconds,
                                                                      videos)]

    def _interleaved(self, video: tuple[int, list[int], float, bool], audio_tokens: int) -> str:
        """`<|audio_start|>` + video and audio placeholders ordered by time (a video token of temporal
        group i at i x seconds-per-grid x 13, audio token j at j) + `<|audio_end|>`, as the processor
        lays them out; the template's `<|vision_start|>` / `<|vision_end|>` stay around it."""
        _, (t, h, w), seconds, _ = video
        per_t = (h // self.visual.merge_size) * (w // self.visual.merge_size)
        times = np.repeat(np.arange(t), per_t) * seconds * self.position_id_per_seconds
        rank_v, rank_a = merge_ranks(torch.from_numpy(times), torch.arange(audio_tokens, dtype=torch.float64))
        slots = np.empty(len(times) + audio_tokens, dtype=object)
        slots[rank_v.numpy()], slots[rank_a.numpy()] = _PADS[2], _PADS[0]
        return "<|audio_start|>" + "".join(slots) + "<|audio_end|>"

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)
