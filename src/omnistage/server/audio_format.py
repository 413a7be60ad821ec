"""Encode the engine's float32 mono 24 kHz audio into response formats, through soundfile (libsndfile).

Whole files: wav / flac (PCM_16), mp3 / opus (when this libsndfile has them, probed at import), pcm16 / pcm
(raw s16le). Streams: raw s16le; "wav" streams open with one header of unknown length. A format that is not
available is a 400 that names the available ones, never another format in its place.
"""

from __future__ import annotations

import io
import struct
from typing import Literal, get_args

import numpy as np
import soundfile as sf

from omnistage.outputs import SAMPLE_RATE
from omnistage.server.errors import bad_request

AudioFormat = Literal["wav", "mp3", "flac", "opus", "aac", "pcm16", "pcm"]
FORMATS: tuple[str, ...] = get_args(AudioFormat)
RAW_FORMATS = ("pcm16", "pcm")
STREAM_FORMATS = ("pcm16", "pcm", "wav")
MEDIA_TYPES = {"wav": "audio/wav", "mp3": "audio/mpeg", "flac": "audio/flac", "opus": "audio/ogg",
               "aac": "audio/aac", "pcm16": "audio/pcm", "pcm": "audio/pcm"}
# API name -> libsndfile (format, subtype); libsndfile has no AAC encoder.
_SOUNDFILE = {"wav": ("WAV", "PCM_16"), "flac": ("FLAC", "PCM_16"), "mp3": ("MP3", "MPEG_LAYER_III"),
              "opus": ("OGG", "OPUS")}


def _probe() -> tuple[str, ...]:
    formats = sf.available_formats()
    have = {name for name, (fmt, sub) in _SOUNDFILE.items()
            if fmt in formats and sub in sf.available_subtypes(fmt)}
    return tuple(f for f in FORMATS if f in have or f in RAW_FORMATS)


SUPPORTED_FORMATS = _probe()


def check_format(fmt: str, stream: bool = False, param: str = "audio.format") -> str:
    """`fmt` if this server can produce it (as a stream when `stream`), else a 400 naming the ones it can."""
    allowed = tuple(f for f in SUPPORTED_FORMATS if f in STREAM_FORMATS) if stream else SUPPORTED_FORMATS
    if fmt not in allowed:
        kind = "streamed audio" if stream else "audio"
        supported = ", ".join(allowed)
        raise bad_request(f"{param}: {fmt!r} is not supported for {kind}; supported: {supported}", param)
    return fmt


def to_pcm16(audio: np.ndarray) -> np.ndarray:
    """float samples in [-1, 1] (clipped; NaN -> 0) -> int16 (little-endian), scaled by 32767."""
    x = np.clip(np.nan_to_num(np.asarray(audio, dtype=np.float32).reshape(-1), nan=0.0), -1.0, 1.0)
    return np.rint(x * 32767.0).astype("<i2")


def encode(audio: np.ndarray, fmt: str) -> bytes:
    """A whole file (or raw s16le for pcm16 / pcm) of mono audio at SAMPLE_RATE."""
    check_format(fmt)
    pcm = to_pcm16(audio)
    if fmt in RAW_FORMATS:
        return pcm.tobytes()
    container, subtype = _SOUNDFILE[fmt]
    # NOTE: PCM_16 formats get the int16 samples, so every path shares one float -> int16 conversion.
    data = pcm if subtype == "PCM_16" else pcm.astype(np.float32) / 32767.0
    buf = io.BytesIO()
    sf.write(buf, data, SAMPLE_RATE, format=container, subtype=subtype)
    return buf.getvalue()


def wav_stream_header(sample_rate: int = SAMPLE_RATE) -> bytes:
    """A 16-bit mono WAV header whose sizes say "unknown" (0xFFFFFFFF), for audio streamed after it."""
    return struct.pack("<4sI4s4sIHHIIHH4sI", b"RIFF", 0xFFFFFFFF, b"WAVE", b"fmt ", 16, 1, 1, sample_rate,
                       sample_rate * 2, 2, 16, b"data", 0xFFFFFFFF)


class AudioStreamEncoder:
    """Bytes per audio chunk of a stream: raw s16le; a "wav" stream's first chunk starts with
    wav_stream_header(), so the concatenated bytes are one WAV file."""

    def __init__(self, fmt: str, param: str = "audio.format") -> None:
        self.format = check_format(fmt, stream=True, param=param)
        self._header = wav_stream_header() if fmt == "wav" else b""

    def encode(self, audio: np.ndarray) -> bytes:
        out, self._header = self._header + to_pcm16(audio).tobytes(), b""
        return out

