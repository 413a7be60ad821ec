"""Encoder rows by media key (models/qwen3_omni/media_keys.py), least recently used out past a byte
capacity: the same audio or picture sent again (a conversation's history, a popular image) is encoded
once. Rows stay on the encoder's device."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from omnistage.models.qwen3_omni.encoders import VisualEmbeds

Rows = Any  # torch.Tensor (audio) or VisualEmbeds


def nbytes(rows: Rows) -> int:
    tensors = [rows] if isinstance(rows, torch.Tensor) else [rows.embeds, *rows.deepstack]
    return sum(t.numel() * t.element_size() for t in tensors)


class EncoderCache:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity, self.size = capacity_bytes, 0
        self.rows: OrderedDict[bytes, Rows] = OrderedDict()
        self.queries = self.hits = 0  # items looked up / found

    def get(self, key: bytes | None) -> Rows | None:
        self.queries += 1
        rows = self.rows.get(key) if key is not None else None
        if rows is not None:
            self.hits += 1
            self.rows.move_to_end(key)
        return rows

    def put(self, key: bytes | None, rows: Rows) -> None:
        size = nbytes(rows)
        if key is None or key in self.rows or size > self.capacity:
            return
        self.rows[key] = rows
        self.size += size
        while self.size > self.capacity:
            self.size -= nbytes(self.rows.popitem(last=False)[1])

    def stats(self) -> dict[str, int]:
        return dict(encoder_cache_queries=self.queries, encoder_cache_hits=self.hits)


def split_visual(enc: VisualEmbeds, counts: list[int]) -> list[VisualEmbeds]:
    levels = [level.split(counts) for level in enc.deepstack]
    return [VisualEmbeds(rows, [level[j] for level in levels]) for j, rows in enumerate(enc.embeds.split(counts))]


def join_visual(items: list[VisualEmbeds]) -> VisualEmbeds:
    if len(items) == 1:
        return items[0]
    return VisualEmbeds(torch.cat([v.embeds for v in items]),
                        [torch.cat(level) for level in zip(*(v.deepstack for v in items))])
