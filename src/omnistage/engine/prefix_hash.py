"""Block hashes of a prompt for the prefix cache (engine/block_manager.py): block i's hash covers its token
ids, the keys of the media whose placeholders start in it, and block i - 1's hash, so equal hashes mean
equal prompts up to the block's end (media included: equal placeholder ids are not equal audio)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

MediaSpan = tuple[int, int, bytes]  # (first, end) prompt positions of a run of placeholders, its media's key


def block_hashes(ids: Sequence[int], block_size: int, spans: Sequence[MediaSpan] = ()) -> list[bytes]:
    """The hashes of the prompt's full blocks."""
    tokens = np.asarray(ids, dtype=np.int64)
    out, parent, spans = [], b"", sorted(spans)
    k = 0
    for start in range(0, len(tokens) - block_size + 1, block_size):
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(tokens[start:start + block_size].tobytes())
        while k < len(spans) and spans[k][0] < start + block_size:
            h.update(spans[k][2])
            k += 1
        parent = h.digest()
        out.append(parent)
    return out
