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


def speech_only(pcm: np.ndarray, level: float = 0.01) -> np.ndarray:
    """The clip up to its last sample above `level` of full scale: espeak-ng ends a clip with ~0.26 s of
    near-silence, which would count as speech time before the speaker's real end."""
    loud = np.flatnonzero(np.abs(pcm.astype(np.int32)) > level * 32768)
    return pcm[:loud[-1] + 1] if loud.size else pcm[:0]
