"""The spoken-question clips shipped in omnistage/data/speech/ (espeak-ng, see data/README.md), as pcm16."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import soundfile as sf

SPEECH_DIR = Path(__file__).parents[1] / "data" / "speech"
CLIPS = ("question_2s", "question_3s", "question_5s", "question_20s")


def speech_clip(name: str, rate: int = 24000) -> np.ndarray:
    """A clip as int16 mono at `rate` (the Realtime API's pcm16 is 24 kHz)."""
    from omnistage.media.decode import resample

    wav, clip_rate = sf.read(SPEECH_DIR / f"{name}.wav", dtype="float32")
    return pcm16(resample(wav, clip_rate, rate))


def pcm16(wav: np.ndarray) -> np.ndarray:
    return np.clip(np.round(wav * 32768.0), -32768, 32767).astype(np.int16)
