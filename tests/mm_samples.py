"""Media made in memory for the multimodal engine tests: images, videos (with an audio track), tones."""

from __future__ import annotations

import numpy as np
from PIL import Image

from omnistage.media import VideoItem

TINY = {"min_pixels": 64 * 64, "max_pixels": 96 * 96}  # per-item options: a few merged tokens per frame


def image(seed: int, h: int = 40, w: int = 56) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8))


def video(seed: int, frames: int = 5, fps: float = 2.0, audio_seconds: float | None = None) -> VideoItem:
    rng = np.random.default_rng(seed)
    track = None if audio_seconds is None else (0.3 * np.sin(np.arange(int(16000 * audio_seconds)) / 7)).astype(
        np.float32)
    return VideoItem(rng.integers(0, 255, (frames, 36, 52, 3), dtype=np.uint8), fps, np.arange(frames) / fps,
                     np.arange(frames), fps, frames, track)


def tone(seconds: float) -> np.ndarray:
    return (0.3 * np.sin(2 * np.pi * 330 * np.arange(int(16000 * seconds)) / 16000)).astype(np.float32)


TWO_TURNS = [
    {"role": "system", "content": "You are a helpful voice."},
    {"role": "user", "content": [{"type": "image", "image": image(3, 30, 44)}, {"type": "audio", "audio": tone(0.7)},
                                 "What do you see and hear?"]},
    {"role": "assistant", "content": "A picture and a tone."},
    {"role": "user", "content": [{"type": "video", "video": video(4, 4, 1.0, 2.5), **TINY},
                                 {"type": "image", "image": image(5, 20, 70), "max_pixels": 64 * 64}, "And now?"]},
]
