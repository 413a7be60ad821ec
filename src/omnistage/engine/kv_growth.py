"""KV blocks taken as requests grow, and given back for a while when they run out, as vLLM does (its swap
preemption). A request holds blocks for the rows computed so far and takes the next ones as it goes (`grant`: while
blocks are free; refused, it waits a step). Before each step the stage calls `make_room` with what its running
requests' next rows take: the oldest requests swapped out come back first while that leaves those blocks free, then
the newest running ones are swapped out (their blocks copied to host memory, bit for bit, and freed) while fewer
are free, one always left running. A request swapped out skips the steps until it is back; nothing new is admitted
meanwhile. Since a request alone always fits (`input_checks.check_fits`), the oldest one always goes on.

A prompt still growing (a realtime turn being spoken) is a running request like the others."""

from __future__ import annotations

import logging
from collections import OrderedDict

import torch

from omnistage.engine.block_manager import BlockManager

logger = logging.getLogger(__name__)
WARN_EVERY = 50  # swaps between two warnings, as vLLM's preemption warning


class KvGrowth:
    def __init__(self, blocks: BlockManager, cache: torch.Tensor, name: str = "") -> None:
        """`cache`: the stage's paged KV cache, `[2, layers, blocks, block_size, ...]` (`allocate_kv_cache`);
        `name`: the stage's, for the log."""
        self.blocks, self.cache, self.name = blocks, cache, name
        self.swapped: OrderedDict[str, torch.Tensor] = OrderedDict()  # request -> its blocks' rows on the host
        self.waits = self.swaps = 0  # grants refused; requests swapped out

    def grant(self, seq_id: str, tokens: int, reserve: int = 0) -> bool:
        """Blocks for `tokens` rows of `seq_id` in all, if that many are free beyond `reserve` (what the running
        requests' next rows take: `make_room`'s, for an admission); False: nothing changed."""
        need = self.blocks.blocks_needed(seq_id, tokens)
        if need + reserve > len(self.blocks.free):
            self.waits += 1
            return False
        if need:
            self.blocks.allocate(seq_id, tokens)
        return True

    def release(self, seq_id: str) -> None:
        self.swapped.pop(seq_id, None)
        self.blocks.release(seq_id)

    def make_room(self, needs: dict[str, int]) -> int:
        """Before a step: `needs` the blocks each running request (not swapped out; oldest first) takes for its
        next rows. Swapped-out requests come back, oldest first, while their blocks and one more leave those
        free; then the newest running ones go out while fewer than those are free and more than one runs.
        Returns the blocks the running requests' next rows take now."""
        want = sum(needs.values())
        for seq_id, rows in list(self.swapped.items()):
            if rows.shape[2] + 1 + want > len(self.blocks.free):
                break
            self._swap_in(seq_id)
            want += 1
        running = list(needs)
        while len(self.blocks.free) < want and len(running) > 1:
            victim = running.pop()
            want -= needs[victim]
            self._swap_out(victim)
        return want

    def _swap_out(self, seq_id: str) -> None:
        # NOTE: queued on the stage's stream behind the step in flight, which may still write these blocks
        index = torch.tensor(self.blocks.tables.get(seq_id, []), dtype=torch.long, device=self.cache.device)
        rows = self.cache.index_select(2, index)
        if rows.is_cuda:  # NOTE: pinned, so that the copy back is ordered on the stream after this one
            rows = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True).copy_(rows, non_blocking=True)
        self.swapped[seq_id] = rows
        self.blocks.release(seq_id)
        if self.swaps % WARN_EVERY == 0:
            logger.warning("%s: KV cache full, request %s swapped out to host memory (%d so far): its output pauses "
                           "until blocks free; more KV (gpu_memory_utilization, kv_cache_memory) or lower max_tokens / "
                           "max_audio_frames avoid it", self.name, seq_id, self.swaps + 1)
        self.swaps += 1

    def _swap_in(self, seq_id: str) -> None:
        rows = self.swapped.pop(seq_id)
        table = self.blocks.allocate(seq_id, rows.shape[2] * self.blocks.block_size)
        index = torch.tensor(table, dtype=torch.long, device=self.cache.device)
        self.cache.index_copy_(2, index, rows.to(self.cache.device, non_blocking=True))
