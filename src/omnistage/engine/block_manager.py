"""Paged KV cache bookkeeping: a free list of fixed-size blocks, each sequence's block table, and the prefix
cache (as vLLM's automatic prefix caching): a full block of a prompt, once computed, is kept under its hash
(`prefix_hash.block_hashes`) with what the stage stores beside it, shared by reference count, and freed
blocks are taken least recently used first, so a later prompt with the same prefix finds them."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, extra_capacity: int = 0) -> None:
        """`extra_capacity`: bytes of tensors `register` may keep beside cached blocks."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # taken from the front
        self.tables: dict[str, list[int]] = {}
        self.refs = [0] * num_blocks
        self.cached: dict[bytes, int] = {}  # block hash -> block
        self.hash_of: dict[int, bytes] = {}
        self.extra: dict[int, torch.Tensor] = {}  # block -> what its owner stored with it (`register`)
        self.extra_capacity, self.extra_bytes = extra_capacity, 0
        self.queries = self.hits = 0  # prompt tokens looked up / found, as vLLM's prefix cache counters

    def blocks_needed(self, seq_id: str, num_tokens: int) -> int:
        """Extra blocks `seq_id` needs to hold `num_tokens` tokens in all."""
        have = len(self.tables.get(seq_id, ()))
        return max(0, -(-num_tokens // self.block_size) - have)

    def can_allocate(self, seq_id: str, num_tokens: int) -> bool:
        return self.blocks_needed(seq_id, num_tokens) <= len(self.free)

    def allocate(self, seq_id: str, num_tokens: int) -> list[int]:
        """Grow `seq_id`'s table to hold `num_tokens` tokens; returns the table."""
        need = self.blocks_needed(seq_id, num_tokens)
        if need > len(self.free):
            raise MemoryError(f"KV cache full: {seq_id} needs {need} blocks, {len(self.free)} free")
        table = self.tables.setdefault(seq_id, [])
        for _ in range(need):
            block = self.free.popitem(last=False)[0]
            self._evict(block)
            self.refs[block] = 1
            table.append(block)
        return table

    def reserve(self) -> int:
        """Take one free block out of the pool for good (e.g. the block that padding rows of a CUDA
        graph write): no sequence ever gets it, and it counts neither as used nor in the total."""
        if not self.free:
            raise MemoryError("KV cache full: no block left to reserve")
        self.num_blocks -= 1
        block = self.free.popitem()[0]
        self._evict(block)
        return block

    def release(self, seq_id: str) -> None:
        for block in self.tables.pop(seq_id, ()):
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self.free[block] = None
                if block not in self.hash_of:  # NOTE: nothing to keep: reused before the cached blocks
                    self.free.move_to_end(block, last=False)

    def match(self, seq_id: str, hashes: Sequence[bytes], max_tokens: int) -> list[int]:
        """The longest run of cached blocks for the prompt's block `hashes`, of at most `max_tokens`
        tokens, taken into `seq_id`'s (empty) table; returns them."""
        blocks = []
        for h in hashes[:max_tokens // self.block_size]:
            if (block := self.cached.get(h)) is None:
                break
            blocks.append(block)
        self.queries += len(hashes) * self.block_size
        self.hits += len(blocks) * self.block_size
        for block in blocks:
            self.free.pop(block, None)
            self.refs[block] += 1
        if blocks:
            self.tables[seq_id] = list(blocks)
        return blocks

    def register(self, seq_id: str, hashes: Sequence[bytes], extra: Sequence[torch.Tensor | None] = ()) -> None:
        """`seq_id`'s first len(hashes) blocks (computed) are cached under `hashes`, each with its `extra`
        (or None), up to the first whose extra would pass `extra_capacity`; a hash already cached keeps
        its block."""
        for i, (block, h) in enumerate(zip(self.tables.get(seq_id, ()), hashes)):
            rows = extra[i] if i < len(extra) else None
            size = 0 if rows is None else rows.numel() * rows.element_size()
            if self.extra_bytes + size > self.extra_capacity:
                return
            if h not in self.cached and block not in self.hash_of:
                self.cached[h], self.hash_of[block] = block, h
                if rows is not None:
                    self.extra[block], self.extra_bytes = rows, self.extra_bytes + size

    def _evict(self, block: int) -> None:
        if (h := self.hash_of.pop(block, None)) is not None:
            del self.cached[h]
            if (rows := self.extra.pop(block, None)) is not None:
                self.extra_bytes -= rows.numel() * rows.element_size()

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    @property
    def capacity(self) -> int:
        """The most tokens one sequence can hold."""
        return self.num_blocks * self.block_size

    def stats(self) -> dict[str, int]:
        return dict(kv_blocks_used=self.num_used, kv_blocks_total=self.num_blocks)
