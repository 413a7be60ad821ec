"""KV blocks taken as requests grow, as vLLM allocates them (without its preemption). A request holds blocks for the
rows computed so far and takes the next ones as it goes; `KvGrowth.grant` refuses a growth that could leave the
running requests all waiting for blocks that none of them will free. After a grant there must still be an order in
which each running request in turn can reach its limit (prompt + max_tokens, or the talker's prompt + max_frames)
with the free blocks plus those the requests before it free when they end: the banker's algorithm with one kind
of resource, run only when the free blocks are fewer than what all the limits still need. A refused request waits
for a step and keeps what it holds; the one first in that order can always go on, so one always ends.

A prompt still growing (a realtime turn being spoken) has no limit yet and cannot end before its user stops: its
blocks count as held for good, it is never in that order, and a growth of it is granted only while the others
keep theirs; once whole, it joins the order (or, refused, waits as it was)."""

from __future__ import annotations

from omnistage.engine.block_manager import BlockManager


class KvGrowth:
    def __init__(self, blocks: BlockManager) -> None:
        self.blocks = blocks
        self.limits: dict[str, int] = {}  # running request with a known end -> the most tokens it may come to hold
        self.waits = 0  # grants refused

    def grant(self, seq_id: str, tokens: int, limit: int | None) -> bool:
        """Blocks for `tokens` rows of `seq_id`, which may come to hold `limit` (its limit from now on; None: a
        prompt still growing), unless that could end in a deadlock or fewer blocks are free; False: nothing
        changed."""
        old = self.limits.get(seq_id)
        need = self.blocks.blocks_needed(seq_id, tokens)
        raised = limit is not None and (old is None or limit > old)
        if raised:
            self.limits[seq_id] = limit
        if (need or raised) and not (need <= len(self.blocks.free) and self._safe(seq_id, need)):
            if raised and old is None:
                del self.limits[seq_id]
            elif raised:
                self.limits[seq_id] = old
            self.waits += 1
            return False
        if need:
            self.blocks.allocate(seq_id, tokens)
        return True

    def release(self, seq_id: str) -> None:
        self.limits.pop(seq_id, None)
        self.blocks.release(seq_id)

    def _safe(self, seq_id: str, extra: int) -> bool:
        """Whether every limit stays reachable once `seq_id` holds `extra` more blocks."""
        bs, tables = self.blocks.block_size, self.blocks.tables
        free = len(self.blocks.free) - extra
        rest = []
        for sid, limit in self.limits.items():
            held = len(tables.get(sid, ())) + (extra if sid == seq_id else 0)
            rest.append((max(0, min(-(-limit // bs), self.blocks.num_blocks) - held), sid))
        if sum(r for r, _ in rest) <= free:
            return True
        refs = self.blocks.refs
        for r, sid in sorted(rest):  # NOTE: with one resource, the smallest remaining need first finds an order
            if r > free:
                return False
            # NOTE: blocks shared through the prefix cache may outlive it: only its own count as freed
            free += sum(refs[b] == 1 for b in tables.get(sid, ())) + (extra if sid == seq_id else 0)
        return True
