"""Chat messages with OpenAI or Qwen-native content parts -> the processor's conversation format (as the
Qwen3-Omni chat template and qwen-omni-utils expect it) and the decoded media items, in order."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from PIL import Image

from omnistage.media.decode import audio_array, decode_audio_bytes, decode_image_bytes, rgb_image
from omnistage.media.fetch import load_bytes
from omnistage.media.policy import MediaError, MediaPolicy
from omnistage.media.video import VideoItem, decode_video_bytes, video_from_frames

KIND = {"image_url": "image", "image": "image", "input_audio": "audio", "audio_url": "audio", "audio": "audio",
        "video_url": "video", "video": "video"}
# Per-item knobs, named as qwen-omni-utils names them.
OPTIONS = ("fps", "nframes", "min_frames", "max_frames", "min_pixels", "max_pixels", "total_pixels",
           "resized_height", "resized_width", "audio_start", "audio_end", "video_start", "video_end")


@dataclass
class MediaItems:
    """`conversation`: messages whose parts are {"type": "text", "text"} or {"type": kind, kind: decoded item,
    **options}. `audios` is the processor's audio list: audio parts and, with `use_audio_in_video`, each
    video's track, in order of appearance. `*_options[i]`: the knobs given for images[i] / videos[i]
    (videos always carry "fps": the sampled frames' rate)."""

    conversation: list[dict[str, Any]] = field(default_factory=list)
    audios: list[np.ndarray] = field(default_factory=list)
    images: list[Image.Image] = field(default_factory=list)
    videos: list[VideoItem] = field(default_factory=list)
    image_options: list[dict[str, Any]] = field(default_factory=list)
    video_options: list[dict[str, Any]] = field(default_factory=list)
    use_audio_in_video: bool = False

    def add(self, kind: str, item: Any, options: dict[str, Any]) -> None:
        if kind == "audio":
            self.audios.append(item)
        elif kind == "image":
            self.images.append(item)
            self.image_options.append(options)
        else:
            self.videos.append(item)
            self.video_options.append({**options, "fps": item.fps})
            if self.use_audio_in_video:
                self.audios.append(item.audio)


def media_count(messages: list[dict[str, Any]], kinds: tuple[str, ...] = ("audio", "image", "video")) -> int:
    """The media parts of those kinds in the messages' contents."""
    contents = [m.get("content") for m in messages if isinstance(m, dict)]
    return sum(isinstance(p, dict) and KIND.get(p.get("type")) in kinds
               for c in contents if isinstance(c, list) for p in c)


def to_conversation(messages: list[dict[str, Any]], policy: MediaPolicy | None = None,
                    use_audio_in_video: bool = False) -> MediaItems:
    """Decode every media part (fetching it under `policy`; default: `MediaPolicy()`). Raises MediaError
    naming the item, e.g. "messages[0].content[2] (image_url): cannot decode image"."""
    policy = policy or MediaPolicy()
    listed = [(i, m.get("content") or "") for i, m in enumerate(messages)]
    if (count := media_count(messages)) > policy.max_items:
        raise MediaError(f"messages: {count} media items, more than {policy.max_items} per request",
                         "messages")
    items = MediaItems(use_audio_in_video=use_audio_in_video)
    for (i, content), m in zip(listed, messages):
        parts = [content] if isinstance(content, str) else content
        items.conversation.append({"role": m["role"], "content": [
            _part(p, f"messages[{i}].content[{j}]", items, policy) for j, p in enumerate(parts)]})
    return items


def _part(part: Any, name: str, items: MediaItems, policy: MediaPolicy) -> dict[str, Any]:
    if isinstance(part, str):
        return {"type": "text", "text": part}
    type_ = part.get("type") if isinstance(part, dict) else None
    if type_ == "text":
        return {"type": "text", "text": part.get("text", "")}
    if type_ not in KIND:
        raise MediaError(f"{name}: unsupported content part type {type_!r}", name)
    kind, options = KIND[type_], {k: part[k] for k in OPTIONS if part.get(k) is not None}
    try:
        item = decode_media(kind, _source(part, type_, kind), policy, options, items.use_audio_in_video)
    except MediaError as e:  # (its cause, if any: the decoder's error)
        raise MediaError(f"{name} ({type_}): {e}", name) from e.__cause__
    items.add(kind, item, options)
    return {"type": kind, kind: item, **options}


def decode_media(kind: str, source: Any, policy: MediaPolicy, options: dict[str, Any] | None = None,
                 with_audio: bool = False) -> Any:
    """One "image" / "audio" / "video" item from its URL, path, data URL or value, as a chat message's part
    is decoded; whatever is wrong with it is a MediaError (e.g. "cannot decode image")."""
    try:
        return _DECODE[kind](source, options or {}, policy, with_audio)
    except MediaError:
        raise
    except Exception as e:  # NOTE: decoders raise many types on hostile input; all of them are the client's
        raise MediaError(f"cannot decode {kind}") from e


def _source(part: dict[str, Any], type_: str, kind: str) -> Any:
    """The part's payload: a URL, path or data URL, or (Python API) a decoded value."""
    if type_ == "input_audio":
        value = part.get("input_audio")
        data = value.get("data") if isinstance(value, dict) else None
        if not isinstance(data, str) or not data:
            raise MediaError("input_audio.data: base64 audio is required")
        return f"data:;base64,{data}"
    value = part.get(type_) if type_ in part else part.get(f"{kind}_url")
    if isinstance(value, dict):
        value = value.get("url")
    if value is None or isinstance(value, str) and not value:
        raise MediaError(f"no {kind} given")
    return value


def _audio(source: Any, options: dict[str, Any], policy: MediaPolicy, _: bool) -> np.ndarray:
    start, end = options.get("audio_start", 0.0), options.get("audio_end")
    if isinstance(source, str):
        return decode_audio_bytes(load_bytes(source, policy), start, end, policy.max_audio_seconds)
    return audio_array(source, start, end, policy.max_audio_seconds)


def _image(source: Any, options: dict[str, Any], policy: MediaPolicy, _: bool) -> Image.Image:
    if isinstance(source, Image.Image):
        return rgb_image(source, policy.max_image_pixels)
    if not isinstance(source, str):
        raise MediaError(f"an image is a URL, a path or a PIL image, not {type(source).__name__}")
    return decode_image_bytes(load_bytes(source, policy), policy.max_image_pixels)


def _video(source: Any, options: dict[str, Any], policy: MediaPolicy, with_audio: bool) -> VideoItem:
    if isinstance(source, VideoItem):
        video = source
    elif isinstance(source, (list, tuple)):
        if with_audio:
            raise MediaError("a video given as frames has no audio track (use_audio_in_video needs one)")
        if not 0 < len(source) <= policy.max_video_frames:
            raise MediaError(f"a video given as frames needs 1 to {policy.max_video_frames} of them")
        video = video_from_frames([_image(f, {}, policy, False) for f in source], options)
    elif isinstance(source, str):
        video = decode_video_bytes(load_bytes(source, policy), options, policy, with_audio)
    else:
        raise MediaError(f"a video is a URL, a path or a list of frames, not {type(source).__name__}")
    if with_audio and video.audio is None:
        raise MediaError("no audio track (use_audio_in_video needs one)")
    return video


_DECODE: dict[str, Callable[[Any, dict[str, Any], MediaPolicy, bool], Any]] = {
    "audio": _audio, "image": _image, "video": _video}
