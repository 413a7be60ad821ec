"""Log-mel features of clips seen before (`FeatureCache`): a conversation's earlier audios come back with every
turn (a realtime session's history, a chat client resending it), and their features need not be made again.

The feature extractor pads a request's clips to the longest, and a clip's last frames depend on that padding,
so an entry is keyed by the clip's samples AND the padded length: a clip's features made alone at the batch's
length equal its row of the batch's (bit for bit, `tests/test_feature_cache.py`).
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable

import numpy as np
import torch

Features = tuple[torch.Tensor, torch.Tensor]  # [mels, frames], [frames]


class FeatureCache:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity, self.bytes = capacity_bytes, 0
        self._entries: OrderedDict[bytes, Features] = OrderedDict()
        self._lock = threading.Lock()  # NOTE: the processor runs in several threads at once

    def features(self, audios: list[np.ndarray], make: Callable[[np.ndarray, int], Features]) -> Features:
        """Clips (16 kHz float32) -> their features padded to the longest `[n, mels, frames]` and masks
        `[n, frames]`, each row made by `make(clip, padded samples)` unless held."""
        length = max(len(a) for a in audios)
        rows = [self._get(a, length, make) for a in audios]
        return torch.stack([f for f, _ in rows]), torch.stack([m for _, m in rows])

    def _get(self, clip: np.ndarray, length: int, make: Callable[[np.ndarray, int], Features]) -> Features:
        key = hashlib.blake2b(np.ascontiguousarray(clip, np.float32).data, digest_size=16,
                              person=length.to_bytes(8, "little")).digest()
        with self._lock:
            if (hit := self._entries.get(key)) is not None:
                self._entries.move_to_end(key)
                return hit
        feats = make(clip, length)
        size = feats[0].nbytes + feats[1].nbytes
        with self._lock:
            if key not in self._entries and size <= self.capacity:
                self._entries[key] = feats
                self.bytes += size
                while self.bytes > self.capacity:
                    _, (f, m) = self._entries.popitem(last=False)
                    self.bytes -= f.nbytes + m.nbytes
        return feats
