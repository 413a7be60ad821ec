"""The spoken-question clips shipped in omnistage/data/speech/ (espeak-ng, see data/README.md), as pcm16."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import soundfile as sf

from omnistage.bench.workload import TAGS

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


def nudged(wav: np.ndarray, tag: int) -> np.ndarray:
    """int16 samples with the two loudest moved towards zero by 1-64 LSB each: 4096 variants."""
    out = wav.copy()
    for i, step in zip(np.argsort(-np.abs(out.astype(np.int32)))[:2], (1 + tag % 64, 1 + tag // 64 % 64)):
        out[i] -= int(np.sign(out[i])) * step
    return out


def turn_clips(pcm: np.ndarray, turns: int, repeat: bool = False) -> list[np.ndarray]:
    """A session's turns' speech: each its own variant of `pcm` (`speech.nudged`), as different users' and turns'
    speech differ, so the server's encoder cache finds a session's own history but not other sessions' same clip;
    `repeat`: `pcm` every time."""
    return [pcm if repeat else nudged(pcm, next(TAGS)) for _ in range(turns)]
