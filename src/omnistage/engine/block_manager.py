"""Paged KV cache bookkeeping: a free list of fixed-size blocks, and each sequence's block table."""

from __future__ import annotations

from collections import deque


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free: deque[int] = deque(range(num_blocks))
        self.tables: dict[str, list[int]] = {}

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
        table.extend(self.free.popleft() for _ in range(need))
        return table

    def reserve(self) -> int:
        """Take one free block out of the pool for good (e.g. the block that padding rows of a CUDA
        graph write): no sequence ever gets it, and it counts neither as used nor in the total."""
        if not self.free:
            raise MemoryError("KV cache full: no block left to reserve")
        self.num_blocks -= 1
        return self.free.pop()

    def release(self, seq_id: str) -> None:
        self.free.extend(self.tables.pop(seq_id, ()))

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    @property
    def capacity(self) -> int:
        """The most tokens one sequence can hold."""
        return self.num_blocks * self.block_size

    def stats(self) -> dict[str, int]:
        return dict(kv_blocks_used=self.num_used, kv_blocks_total=self.num_blocks)
