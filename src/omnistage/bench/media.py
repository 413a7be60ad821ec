"""The media of the spoken-question, visual-question and video workloads: the shipped clips and photos
(omnistage/data/, see data/README.md), the 1280x720 and 4032x3024 photos made from them, 320x240 videos made
with PyAV, and a per-request variation, unnoticeable, in what the server decodes (so the server's caches of
encoder rows and prompt prefixes hit only where a workload repeats media on purpose)."""

from __future__ import annotations

import io
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

from omnistage.bench.speech import SPEECH_DIR, nudged
from omnistage.media.decode import AUDIO_INPUT_RATE, decode_audio_bytes

PHOTO_DIR = Path(__file__).parents[1] / "data" / "photos"
SPOKEN = tuple(f"q{i:02d}" for i in range(1, 13))  # data/speech/spoken/: 2-15 s
SHIPPED_PHOTOS = ("astronaut", "coffee", "chelsea", "rocket")
# made from a shipped photo: name -> (source, size); "phone" is a phone camera's 12 MP JPEG
DERIVED_PHOTOS = {"hd": ("rocket", (1280, 720)), "phone": ("coffee", (4032, 3024))}
PHOTOS = (*SHIPPED_PHOTOS, *DERIVED_PHOTOS)
DEFAULT_PHOTOS = (*SHIPPED_PHOTOS, "hd")
VIDEO_SIZE, VIDEO_FPS = (320, 240), 25
PHONE_NOISE = 6.0  # sensor-like noise (std, 8-bit levels): an upscaled photo alone would compress to ~1/5


@dataclass(frozen=True)
class Media:
    name: str
    data: bytes
    mime: str  # audio/flac, audio/wav, image/jpeg or video/mp4
    data_seconds: float = 0.0  # a video's length

    @property
    def format(self) -> str:
        """input_audio.format: "flac", "wav"."""
        return self.mime.split("/")[1]


def _clip_path(name: str) -> Path:
    path = SPEECH_DIR / "spoken" / f"{name}.flac"
    return path if path.exists() else SPEECH_DIR / f"{name}.wav"


def clip_names() -> tuple[str, ...]:
    """Every clip a spoken-question request can carry: the spoken set, then the realtime bench's."""
    return SPOKEN + tuple(sorted(p.stem for p in SPEECH_DIR.glob("*.wav")))


@cache
def spoken_clip(name: str) -> Media:
    if name not in clip_names():
        raise ValueError(f"unknown clip {name!r}: one of {', '.join(clip_names())}")
    path = _clip_path(name)
    return Media(name, path.read_bytes(), f"audio/{path.suffix[1:]}")


@cache
def photo(name: str) -> Media:
    """A shipped photo as it is, or a derived one: the source cropped to the size's aspect and resized."""
    if name not in PHOTOS:
        raise ValueError(f"unknown photo {name!r}: one of {', '.join(PHOTOS)}")
    if name in SHIPPED_PHOTOS:
        return Media(name, (PHOTO_DIR / f"{name}.jpg").read_bytes(), "image/jpeg")
    source, size = DERIVED_PHOTOS[name]
    image = Image.open(PHOTO_DIR / f"{source}.jpg").convert("RGB")
    image = ImageOps.fit(image, size, Image.Resampling.LANCZOS)
    if name == "phone":
        noise = PHONE_NOISE * np.random.default_rng(0).standard_normal((size[1], size[0], 3), dtype=np.float32)
        image = Image.fromarray(np.clip(np.asarray(image) + noise, 0, 255).astype(np.uint8))
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=92)
    return Media(name, buf.getvalue(), "image/jpeg")


@cache
def video(photo_name: str, clip: str, seconds: float) -> Media:
    """`seconds` of a 320x240 window panning across the photo at 25 fps (mpeg4), with the clip (cut or
    padded with silence to the video's length) as its aac track at 16 kHz."""
    return _video(photo_name, clip, seconds, None)


def _video(photo_name: str, clip: str, seconds: float, tag: int | None) -> Media:
    import av

    frames = round(seconds * VIDEO_FPS)
    image = Image.open(io.BytesIO(photo(photo_name).data)).convert("RGB")
    scale = max(VIDEO_SIZE[0] * 1.5 / image.width, VIDEO_SIZE[1] / image.height)
    image = image.resize((round(image.width * scale), round(image.height * scale)), Image.Resampling.BILINEAR)
    pixels = np.asarray(image)
    wav, samples = decode_audio_bytes(spoken_clip(clip).data), round(seconds * AUDIO_INPUT_RATE)
    wav = np.pad(wav, (0, max(0, samples - wav.size)))[:samples]
    if tag is not None:
        wav = nudged((wav * 32767).astype(np.int16), tag).astype(np.float32) / 32767
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("mpeg4", rate=VIDEO_FPS)
        stream.width, stream.height, stream.pix_fmt = *VIDEO_SIZE, "yuv420p"
        track = out.add_stream("aac", rate=AUDIO_INPUT_RATE)
        for i in range(frames):
            x = round((pixels.shape[1] - VIDEO_SIZE[0]) * i / max(1, frames - 1))
            window = np.array(pixels[:VIDEO_SIZE[1], x:x + VIDEO_SIZE[0]])
            if tag is not None:
                window[:8, :8] = _colour(tag)
            out.mux(stream.encode(av.VideoFrame.from_ndarray(window, format="rgb24")))
        out.mux(stream.encode())
        for s in range(0, wav.size, 1024):
            frame = av.AudioFrame.from_ndarray(wav[None, s:s + 1024].copy(), format="fltp", layout="mono")
            frame.sample_rate = AUDIO_INPUT_RATE
            out.mux(track.encode(frame))
        out.mux(track.encode())
    return Media(f"{photo_name}+{clip}", buf.getvalue(), "video/mp4", seconds)


def varied(media: Media, tag: int | None) -> bytes:
    """The media with a change one would hardly notice, from `tag`, in what the server decodes (not only in
    its bytes, which a server's cache of decoded media sees through): a photo's 8x8 corner block, a clip's two
    loudest samples (a few LSB), a video's every frame's corner block and its track's loudest samples.
    None: the bytes as they are."""
    if tag is None:
        return media.data
    if media.mime == "image/jpeg":
        image = np.array(Image.open(io.BytesIO(media.data)).convert("RGB"))
        image[:8, :8] = _colour(tag)
        buf = io.BytesIO()
        Image.fromarray(image).save(buf, format="JPEG", quality=92)
        return buf.getvalue()
    if media.mime.startswith("audio/"):
        import soundfile as sf

        wav, rate = sf.read(io.BytesIO(media.data), dtype="int16")
        buf = io.BytesIO()
        sf.write(buf, nudged(wav, tag), rate, format=media.format.upper(), subtype="PCM_16")
        return buf.getvalue()
    if media.mime == "video/mp4":
        photo_name, clip = media.name.split("+")
        return _video(photo_name, clip, float(media.data_seconds), tag).data
    raise ValueError(f"cannot vary {media.mime}")


def _colour(tag: int) -> list[int]:
    """An 8x8 corner block's colour: far apart for consecutive tags (JPEG keeps it)."""
    return [tag * 37 % 256, tag * 101 % 256, tag * 173 % 256]
