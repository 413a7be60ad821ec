"""A chat message that warms the media path at start (`warm_message`): otherwise the first request of each kind
pays the first use of its decoders and libraries (PyAV's import and codecs, scipy's resampler, Pillow's JPEG
plugin, the feature extractor): on the 2-core CPU 75 ms more for the first 4 s video than for the next, 16 ms
for the first clip, 7 ms for the first photo (benchmarks/HISTORY.md, twelfth session)."""

from __future__ import annotations

import base64
import io
import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import soundfile as sf
from PIL import Image

# NOTE: common sizes: the first large arrays also pay the allocator's first page faults (a 4 s video's patches:
# 24 ms of its first np.take on the 2-core CPU)
RATE, SECONDS, FPS = 24000, 4.0, 4
logger = logging.getLogger(__name__)
PHOTO, FRAME = (480, 640), (240, 320)


def _url(mime: str, data: bytes) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def _tone() -> np.ndarray:
    return (0.1 * np.sin(np.arange(int(RATE * SECONDS)) * 0.05)).astype(np.float32)


def _image() -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((*PHOTO, 3), 128, np.uint8)).save(buf, format="JPEG")
    return buf.getvalue()


def _video() -> bytes | None:
    """An mp4 (mpeg4 frames, an aac track), or None without PyAV (or its encoders)."""
    try:
        return _mp4()
    except Exception:  # noqa: BLE001 - ImportError, or an ffmpeg built without these encoders: no video warm-up
        return None


def _mp4() -> bytes:
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("mpeg4", rate=FPS)
        stream.height, stream.width, stream.pix_fmt = *FRAME, "yuv420p"
        track = out.add_stream("aac", rate=RATE)
        for _ in range(int(FPS * SECONDS)):
            out.mux(stream.encode(av.VideoFrame.from_ndarray(np.zeros((*FRAME, 3), np.uint8), format="rgb24")))
        out.mux(stream.encode())
        wav = _tone()
        for s in range(0, wav.size, 1024):
            frame = av.AudioFrame.from_ndarray(wav[None, s:s + 1024].copy(), format="fltp", layout="mono")
            frame.sample_rate = RATE
            out.mux(track.encode(frame))
        out.mux(track.encode())
    return buf.getvalue()


def warm_message() -> dict[str, Any]:
    """A user message with a 4 s 24 kHz WAV clip, a 640x480 JPEG photo and (with PyAV) a 4 s 320x240 mp4 with an
    audio track: process it with `use_audio_in_video`."""
    wav = io.BytesIO()
    sf.write(wav, _tone(), RATE, format="WAV", subtype="PCM_16")
    parts = [{"type": "input_audio", "input_audio": {"data": base64.b64encode(wav.getvalue()).decode(),
                                                     "format": "wav"}},
             {"type": "image_url", "image_url": {"url": _url("image/jpeg", _image())}}]
    if (video := _video()) is not None:
        parts.append({"type": "video_url", "video_url": {"url": _url("video/mp4", video)}})
    return {"role": "user", "content": [*parts, {"type": "text", "text": "What is this?"}]}


def warm_media(process: Callable[..., Any]) -> bool:
    """`process` (a prompt processor: messages, use_audio_in_video) over `warm_message` once; a failure is logged,
    not raised (the first media request then pays the first uses): whether it ran."""
    start = time.perf_counter()
    try:
        process([warm_message()], use_audio_in_video=True)
    except Exception:  # noqa: BLE001 - a warm-up: serving goes on
        logger.warning("the media warm-up failed; the first media request pays the first uses", exc_info=True)
        return False
    logger.info("media path warmed in %.2f s", time.perf_counter() - start)
    return True
