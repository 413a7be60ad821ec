"""What the media tests share: small media files made in memory (wav, png, mp4 with or without an audio
track, m4a), and helpers."""

from __future__ import annotations

import base64
import io

import av
import numpy as np
import pytest
import soundfile as sf
from PIL import Image

from omnistage.media import MediaError, MediaPolicy, to_conversation


def tone(seconds: float, rate: int, hz: float = 440.0, channels: int = 1) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    wav = (0.3 * np.sin(2 * np.pi * hz * t)).astype(np.float32)
    return np.stack([wav] * channels, 1) if channels > 1 else wav


def wav_bytes(seconds: float = 1.0, rate: int = 16000, channels: int = 1, hz: float = 440.0) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, tone(seconds, rate, hz, channels), rate, format="WAV")
    return buf.getvalue()


def png_bytes(width: int = 40, height: int = 30, rgba: bool = False) -> bytes:
    """A gradient; with `rgba` the left half is fully transparent."""
    img = np.zeros((height, width, 4 if rgba else 3), np.uint8)
    img[..., 0] = np.arange(width)[None] * 5
    img[..., 1] = np.arange(height)[:, None] * 7
    if rgba:
        img[..., 3] = 255
        img[:, : width // 2, 3] = 0
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="PNG")
    return buf.getvalue()


def mp4_bytes(frames: int = 20, fps: int = 10, size: tuple[int, int] = (64, 48),
              audio_seconds: float | None = None, rate: int = 44100) -> bytes:
    """mpeg4 frames whose red channel is 10 * frame index; optionally an aac 440 Hz track."""
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as c:
        video = c.add_stream("mpeg4", rate=fps)
        video.width, video.height, video.pix_fmt = size[0], size[1], "yuv420p"
        audio = c.add_stream("aac", rate=rate) if audio_seconds else None
        for i in range(frames):
            img = np.zeros((size[1], size[0], 3), np.uint8)
            img[..., 0] = 10 * i
            for packet in video.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                c.mux(packet)
        for packet in video.encode():
            c.mux(packet)
        if audio is not None:
            _encode_tone(c, audio, audio_seconds, rate)
    return buf.getvalue()


def m4a_bytes(seconds: float = 1.0, rate: int = 44100) -> bytes:
    """aac in mp4 (libsndfile cannot read it: the PyAV path)."""
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as c:
        _encode_tone(c, c.add_stream("aac", rate=rate), seconds, rate)
    return buf.getvalue()


def _encode_tone(container: av.container.OutputContainer, stream: av.AudioStream, seconds: float,
                 rate: int) -> None:
    wav = tone(seconds, rate)[None]
    for s in range(0, wav.shape[1], 1024):
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(wav[:, s:s + 1024]), format="fltp", layout="mono")
        frame.sample_rate = rate
        for packet in stream.encode(frame):
            container.mux(packet)
    for packet in stream.encode():
        container.mux(packet)


def data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def peak_hz(wav: np.ndarray, rate: int = 16000) -> float:
    spectrum = np.abs(np.fft.rfft(wav))
    return float(np.argmax(spectrum) * rate / wav.size)


def user(*parts: dict | str) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


def check_error(messages: list[dict], needle: str, policy: MediaPolicy | None = None, **kw) -> str:
    """to_conversation's MediaError message, which must contain `needle`."""
    with pytest.raises(MediaError) as e:
        to_conversation(messages, policy, **kw)
    assert needle in str(e.value), str(e.value)
    return str(e.value)
