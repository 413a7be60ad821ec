"""Decode media parts of OpenAI-style messages: audio to 16 kHz mono float32."""

from __future__ import annotations

import base64
import binascii
import io
from math import gcd
from pathlib import Path

import numpy as np
import soundfile as sf

AUDIO_INPUT_RATE = 16000


class MediaError(ValueError):
    """Bad media in a request (a client error)."""


def decode_audio_bytes(data: bytes) -> np.ndarray:
    """Any container libsndfile reads (wav, flac, ogg, mp3 where supported) -> 16 kHz mono float32."""
    try:
        wav, rate = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except Exception as e:  # soundfile raises several types for unreadable data
        raise MediaError("cannot decode audio: not a format libsndfile reads (wav, flac, ogg, mp3), "
                         "or the data is corrupt") from e
    return resample(wav.mean(axis=1), rate, AUDIO_INPUT_RATE)


def resample(wav: np.ndarray, rate: int, target: int) -> np.ndarray:
    if rate == target:
        return wav.astype(np.float32)
    from scipy.signal import resample_poly

    g = gcd(rate, target)
    return resample_poly(wav, target // g, rate // g).astype(np.float32)


def audio_from_url(url: str, allowed_local_dir: str | None = None) -> np.ndarray:
    """`data:audio/...;base64,...` or `file://` (only under `allowed_local_dir`)."""
    if url.startswith("data:"):
        _, _, payload = url.partition(",")
        return decode_audio_bytes(b64decode(payload))
    if url.startswith("file://"):
        path = Path(url[len("file://"):]).resolve()
        if allowed_local_dir is None or not path.is_relative_to(Path(allowed_local_dir).resolve()):
            raise MediaError("local media paths are not allowed (start the server with --allowed-local-media-path)")
        return decode_audio_bytes(path.read_bytes())
    raise MediaError(f"unsupported audio url scheme: {url.split(':', 1)[0]!r} (use data: or file://)")


def b64decode(payload: str) -> bytes:
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise MediaError(f"invalid base64 data: {e}") from e
