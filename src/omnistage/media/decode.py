"""Decoders: audio (soundfile, else PyAV) to 16 kHz mono float32, images (Pillow) to RGB."""

from __future__ import annotations

import io
from math import gcd

import numpy as np
import soundfile as sf
from PIL import Image

from omnistage.media.policy import MediaError

AUDIO_INPUT_RATE = 16000
# NOTE: no formats whose plugins call out (EPS -> Ghostscript) or that are rarely real photos.
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")


def decode_audio_bytes(data: bytes, start: float = 0.0, end: float | None = None,
                       max_seconds: float = float("inf")) -> np.ndarray:
    """Any container libsndfile reads (wav, flac, ogg, mp3), else anything ffmpeg reads (m4a, webm, ...):
    the [start, end) seconds, downmixed, at 16 kHz."""
    try:
        info = sf.info(io.BytesIO(data))
    except sf.SoundFileError:
        from omnistage.media.video import decode_audio_track

        return decode_audio_track(data, start, end, max_seconds)
    first = int(start * info.samplerate)
    last = info.frames if end is None else min(int(end * info.samplerate), info.frames)
    check_seconds((last - first) / info.samplerate, max_seconds, "audio")
    wav, rate = sf.read(io.BytesIO(data), start=first, stop=max(last, first), dtype="float32", always_2d=True)
    return resample(wav.mean(axis=1), rate, AUDIO_INPUT_RATE)


def audio_array(value: object, start: float = 0.0, end: float | None = None,
                max_seconds: float = float("inf")) -> np.ndarray:
    """An array given in the Python API, already 16 kHz mono: cropped like qwen-omni-utils does."""
    wav = np.asarray(value, dtype=np.float32)
    if wav.ndim != 1:
        raise MediaError(f"audio arrays must be mono (1-D), got shape {tuple(wav.shape)}")
    wav = wav[int(start * AUDIO_INPUT_RATE):None if end is None else int(end * AUDIO_INPUT_RATE)]
    check_seconds(wav.size / AUDIO_INPUT_RATE, max_seconds, "audio")
    return wav


def resample(wav: np.ndarray, rate: int, target: int) -> np.ndarray:
    if rate == target:
        return wav.astype(np.float32)
    from scipy.signal import resample_poly

    g = gcd(rate, target)
    return resample_poly(wav, target // g, rate // g).astype(np.float32)


def decode_image_bytes(data: bytes, max_pixels: int) -> Image.Image:
    """The first frame, RGB; transparency composited on white (as qwen-vl-utils does)."""
    image = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)  # NOTE: lazy: the size is known before any pixel is decoded
    return rgb_image(image, max_pixels)


def rgb_image(image: Image.Image, max_pixels: int) -> Image.Image:
    if image.width * image.height > max_pixels:
        raise MediaError(f"image is {image.width}x{image.height}, more than {max_pixels} pixels")
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        white = Image.new("RGB", rgba.size, (255, 255, 255))
        white.paste(rgba, mask=rgba.getchannel("A"))
        return white
    return image.convert("RGB")


def check_seconds(seconds: float, max_seconds: float, kind: str) -> None:
    if seconds > max_seconds:
        raise MediaError(f"{kind} is {seconds:.1f} s long, more than {max_seconds:g} s")
    if seconds <= 0:
        raise MediaError(f"{kind} is empty (nothing in the requested range)")
