"""Per-request penalty state kept on the device in fixed rows (as vLLM's persistent input batch).

A request holds one row ("slot") of `seen [R + 1, V]` (prompt and output ids: repetition penalty) and
`counts [R + 1, V]` (output ids: presence / frequency penalties) from admission to release. A step
gathers its rows by slot and records its sampled tokens by slot (the thinker), or gathers `seen` and
stores it back after the step updated it (the talker's frame head), all on the device: nothing is copied
per request per step, and a step launched before the previous one's tokens reach the host still sees
them (asynchronous output). Row R is scratch for CUDA-graph padding rows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


class PenaltyTable:
    def __init__(self, rows: int, vocab: int, device: torch.device | str, counts: bool = True) -> None:
        """`counts`: keep output counts too (presence / frequency penalties); else `seen` only."""
        self.seen = torch.zeros(rows + 1, vocab, dtype=torch.bool, device=device)
        self.counts = torch.zeros(rows + 1, vocab, dtype=torch.int32, device=device) if counts else None
        self.scratch = rows
        self._free = list(range(rows - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def acquire(self, prompt_ids: torch.Tensor | None = None) -> int:
        """A cleared row, with the prompt's ids marked seen."""
        if not self._free:
            raise RuntimeError("no free penalty row: more requests hold one than the table has rows")
        slot = self._free.pop()
        self.seen[slot].zero_()
        if self.counts is not None:
            self.counts[slot].zero_()
        if prompt_ids is not None:
            # NOTE: index_fill_, not `seen[slot, ids] = True`: setitem copies the scalar to the device blocking
            self.seen[slot].index_fill_(0, prompt_ids.to(self.seen.device, non_blocking=True), True)
        return slot

    def release(self, slot: int) -> None:
        self._free.append(slot)

    def gather(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(seen [B, V], counts [B, V]) of the rows `slots` [B] (device)."""
        return self.seen.index_select(0, slots), self.counts.index_select(0, slots)

    def update_seen(self, slots: torch.Tensor, step: Callable[[torch.Tensor], T]) -> T:
        """`step(seen)` on the rows `slots` [B] gathered ([B, V]; the step marks ids in place), then stored back
        (padding rows may repeat the scratch slot)."""
        seen = self.seen.index_select(0, slots)
        out = step(seen)
        self.seen.index_copy_(0, slots, seen)
        return out

    def record(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Add sampled `tokens` [B] to rows `slots` [B] (padding rows may repeat the scratch slot)."""
        self.seen.index_put_((slots, tokens), torch.ones_like(tokens, dtype=torch.bool))
        self.counts.index_put_((slots, tokens), torch.ones_like(tokens, dtype=torch.int32), accumulate=True)
