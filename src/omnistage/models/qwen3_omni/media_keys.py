"""Content keys of a prompt's media, made beside the processor (off the stage threads): one per item, over
what decides its encoder rows (an audio's valid log-mel frames; an image's or a video's decoded 8-bit pixels
with its processing options: for media within the pixel cap 4-8x fewer bytes than the float patches made
from them), for the encoder cache;
and each run of placeholders with the keys of the items it holds, for the prefix cache."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from omnistage.engine.prefix_hash import MediaSpan


@dataclass(frozen=True)
class MediaKeys:
    audios: tuple[bytes, ...]
    images: tuple[bytes, ...]
    videos: tuple[bytes, ...]
    spans: tuple[MediaSpan, ...]  # in prompt order


def digest(*tensors: torch.Tensor) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for t in tensors:
        h.update(str((t.dtype, tuple(t.shape))).encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy())  # NOTE: its buffer, not a copy
    return h.digest()


def source_key(kind: str, pixels: np.ndarray, options: dict) -> bytes:
    """An image's (`[H, W, 3]`) or a video's sampled frames' (`[T, H, W, 3]`) key: its pixels as decoded and
    its options (the server's processor and limits being fixed, they decide its patches)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(repr((kind, pixels.dtype.str, pixels.shape, sorted(options.items()))).encode())
    h.update(np.ascontiguousarray(pixels))
    return h.digest()


def media_keys(prompt, pad_ids: tuple[int, int, int], images: tuple[bytes, ...], videos: tuple[bytes, ...]
               ) -> MediaKeys | None:
    """Keys of a `PromptInputs`' media (`images` / `videos`: their `source_key`s in order); None when its
    placeholder runs do not match its items."""
    audio_keys = () if prompt.input_features is None else tuple(
        digest(f[:, :n]) for f, n in zip(prompt.input_features, prompt.audio_feature_lens))
    ids = np.asarray(prompt.input_ids)
    pad = np.isin(ids, pad_ids)
    edges = np.flatnonzero(np.diff(np.concatenate([[0], pad.astype(np.int8), [0]])))
    queues = [list(audio_keys), list(images), list(videos)]
    spans = []
    for first, end in zip(edges[::2], edges[1::2]):
        kinds = [bool((ids[first:end] == p).any()) for p in pad_ids]  # audio, image, video
        take = [2, 0] if kinds[2] and kinds[0] else [2] if kinds[2] else [1] if kinds[1] else [0]
        if any(not queues[k] for k in take) or (kinds[1] and (kinds[0] or kinds[2])):
            return None
        spans.append((int(first), int(end), b"".join(queues[k].pop(0) for k in take)))
    if any(queues):
        return None
    return MediaKeys(audio_keys, images, videos, tuple(spans))
