"""Video with PyAV: frames sampled as qwen-omni-utils samples them (fps 2 by default, an even count
between min_frames and max_frames), the audio track at 16 kHz; also a video given as a list of frames."""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from PIL import Image

from omnistage.media.decode import AUDIO_INPUT_RATE, check_seconds, resample
from omnistage.media.policy import MediaError, MediaPolicy

if TYPE_CHECKING:
    import av

FPS, MIN_FRAMES, FRAME_FACTOR = 2.0, 4, 2
# NOTE: demuxers only for media files: playlist-like ones (hls, concat, ...) would open further URLs or files.
CONTAINERS = "mov,mp4,m4a,3gp,3g2,mj2,matroska,webm,avi,asf,flv,mpeg,mpegts,ogg,mp3,aac,wav,flac"


@dataclass
class VideoItem:
    """Sampled frames and their timing; `audio` is the track (16 kHz mono float32) when it was asked for."""

    frames: np.ndarray  # uint8 [T, H, W, 3]
    fps: float  # frames per second of the sampled frames (qwen-omni-utils' "sample fps")
    timestamps: np.ndarray  # float64 [T]: seconds from the video's start of each sampled frame
    frame_indices: np.ndarray  # int64 [T]: indices in the (clipped) source's frames
    source_fps: float
    total_frames: int  # frames in the (clipped) source
    audio: np.ndarray | None = None


def num_frames(options: dict[str, Any], total: int, video_fps: float, max_frames: int) -> int:
    """qwen-omni-utils' smart_nframes: `nframes`, or `fps` (default 2) within [min_frames, max_frames]."""
    if "nframes" in options and "fps" in options:
        raise MediaError("give fps or nframes, not both")
    if total < FRAME_FACTOR:
        raise MediaError(f"video has {total} frame(s), fewer than {FRAME_FACTOR}")
    if "nframes" in options:
        n = round(options["nframes"] / FRAME_FACTOR) * FRAME_FACTOR
    else:
        lo = math.ceil(options.get("min_frames", MIN_FRAMES) / FRAME_FACTOR) * FRAME_FACTOR
        hi = math.floor(options.get("max_frames", min(max_frames, total)) / FRAME_FACTOR) * FRAME_FACTOR
        n = min(max(total / video_fps * options.get("fps", FPS), lo), hi, total)
        n = math.floor(n / FRAME_FACTOR) * FRAME_FACTOR
    if not FRAME_FACTOR <= n <= min(total, max_frames):
        raise MediaError(f"{n} frames requested from a video of {total} (2 to {min(total, max_frames)})")
    return n


def decode_video_bytes(data: bytes, options: dict[str, Any], policy: MediaPolicy, with_audio: bool) -> VideoItem:
    start, end = options.get("video_start", 0.0), options.get("video_end")
    times, video_fps = _frame_times(data)
    keep = np.flatnonzero((times >= start) & (times <= (np.inf if end is None else end)))
    if keep.size == 0:
        raise MediaError("video has no frames in the requested range")
    total = int(keep.size)
    check_seconds(total / video_fps, policy.max_video_seconds, "video")
    n = num_frames(options, total, video_fps, policy.max_video_frames)
    picks = np.round(np.linspace(0, total - 1, n)).astype(np.int64)
    frames = _decode_frames(data, keep[picks], min(policy.max_frame_pixels, policy.max_video_pixels // n))
    audio = decode_audio_track(data, start, end, policy.max_video_seconds) if with_audio else None
    return VideoItem(frames, n / total * video_fps, times[keep[picks]], picks, video_fps, total, audio)


def video_from_frames(images: list[Image.Image], options: dict[str, Any]) -> VideoItem:
    """A video given as frames (qwen-omni-utils pads to an even count by repeating the last one)."""
    if len({im.size for im in images}) != 1:
        raise MediaError("video frames differ in size")
    images = images + images[-1:] * (len(images) % FRAME_FACTOR)
    fps = float(options.get("fps", FPS))
    idx = np.arange(len(images))
    return VideoItem(np.stack([np.asarray(im) for im in images]), fps, idx / fps, idx, fps, len(images))


def decode_audio_track(data: bytes, start: float, end: float | None, max_seconds: float) -> np.ndarray:
    """The first audio stream, [start, end] seconds, downmixed, at 16 kHz."""
    with open_container(data) as container:
        if not container.streams.audio:
            raise MediaError("no audio track (use_audio_in_video needs one)")
        stream = container.streams.audio[0]
        limit = (end if end is not None else start + max_seconds + 1) - start
        to_float = pyav().AudioResampler(format="fltp")
        chunks, rate, got = [], stream.rate, 0
        for frame in container.decode(stream):
            for f in to_float.resample(frame):
                chunks.append(f.to_ndarray().mean(axis=0))
                got += f.samples
            if got > (start + limit) * rate:
                break
    wav = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
    wav = wav[int(start * rate):None if end is None else int(end * rate)]
    check_seconds(wav.size / rate, max_seconds, "audio")
    return resample(wav, rate, AUDIO_INPUT_RATE)


def pyav() -> Any:
    """PyAV, imported on first use: a server without it serves everything but video."""
    try:
        import av
    except ImportError:
        raise MediaError("video input needs PyAV on the server (pip install av)") from None
    return av


def open_container(data: bytes) -> av.container.InputContainer:
    return pyav().open(io.BytesIO(data), container_options={"format_whitelist": CONTAINERS})


def _frame_times(data: bytes) -> tuple[np.ndarray, float]:
    """Presentation times (s) of the first video stream's frames, from the packets (nothing decoded), and
    its frame rate (the container's average, else from the times)."""
    with open_container(data) as container:
        if not container.streams.video:
            raise MediaError("no video stream")
        stream = container.streams.video[0]
        pts = [p.pts for p in container.demux(stream) if p.pts is not None and p.size]
        times = np.sort((np.asarray(pts, np.float64) - (stream.start_time or 0)) * float(stream.time_base))
        span = times[-1] - times[0] if times.size > 1 else 0.0
        fps = float(stream.average_rate or 0) or ((times.size - 1) / span if span > 0 else FPS)
        return times, fps


def _decode_frames(data: bytes, indices: np.ndarray, max_pixels: int) -> np.ndarray:
    wanted, out = set(indices.tolist()), []
    with open_container(data) as container:
        stream = container.streams.video[0]
        for i, frame in enumerate(container.decode(stream)):
            if i in wanted:
                out.append(_rgb(frame, max_pixels))
            if i >= indices[-1]:
                break
    if len(out) != len(indices):
        raise MediaError("video ended early (fewer frames decoded than its packets promise)")
    return np.stack(out)


def _rgb(frame: av.VideoFrame, max_pixels: int) -> np.ndarray:
    w, h = frame.width, frame.height
    if w * h > max_pixels:  # NOTE: ffmpeg scales it down (keeps the aspect ratio) to bound memory
        s = math.sqrt(max_pixels / (w * h))
        w, h = max(1, int(w * s)), max(1, int(h * s))
    return frame.to_ndarray(format="rgb24", width=w, height=h)
