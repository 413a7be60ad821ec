"""The thinker's use of the prefix cache (engine/block_manager.py): a prompt's block hashes at admission,
its longest cached prefix taken when it is first scheduled (those rows are not prefilled again; the
talker's accept-layer rows at their multimodal positions come from the cache with them), and its full
blocks registered once its prompt is computed (at its first token)."""

from __future__ import annotations

import torch

from omnistage.engine.block_manager import BlockManager
from omnistage.engine.prefix_hash import block_hashes
from omnistage.models.qwen3_omni.media_keys import MediaKeys
from omnistage.pipeline.thinker.seq import ThinkerSeq


def prompt_hashes(seq: ThinkerSeq, keys: MediaKeys | None, block_size: int) -> list[bytes] | None:
    """`keys`: the media keys of the prompt `seq` was made from. None where no prefix may be shared: media without
    keys. A growing prompt's (`seq.open`) are those of the rows it has, before the streamed audio: no piece
    rewinds past them (`stream_parts.prefix_prompt`)."""
    if seq.has_mm and keys is None:
        return None
    return block_hashes(seq.prompt_ids.tolist(), block_size, keys.spans if keys is not None else ())


def take_prefix(blocks: BlockManager, seq: ThinkerSeq, graph_tokens: int, max_context: int = 0) -> None:
    """Skip the prompt's cached prefix, once, before its first row is computed (one row at least is left:
    it gives the first token). With prefill graphs (`graph_tokens`: the largest prompt they take whole; 0:
    none), at most `max_context` rows (what a graph run reads past); with none past cached rows (0), not where a
    graph takes the whole prompt: a graph over all of it costs less than an eager step over its new rows (at
    full size ~100 ms of host time, whatever the rows)."""
    if seq.block_hashes is None or seq.num_computed or seq.cached_blocks >= 0:
        return
    if not max_context and seq.prompt_len <= graph_tokens:
        seq.cached_blocks = 0
        return
    limit = min(seq.prompt_len - 1, max_context) if graph_tokens and max_context else seq.prompt_len - 1
    taken = blocks.match(seq.req.request_id, seq.block_hashes, limit)
    seq.cached_blocks, seq.num_computed = len(taken), len(taken) * blocks.block_size
    seq.mm_hidden = [blocks.extra[b] for b in taken if b in blocks.extra]


def register_prefix(blocks: BlockManager, seq: ThinkerSeq) -> None:
    """The prompt's full blocks past the cached ones, with the accept-layer rows of their multimodal
    positions."""
    hashes, seq.block_hashes = seq.block_hashes, None
    done = max(seq.cached_blocks, 0)
    if not hashes or len(hashes) <= done:
        return
    extra: list[torch.Tensor | None] = [None] * len(hashes)
    if seq.has_mm and seq.mm_hidden:
        bs, rows = blocks.block_size, torch.cat(seq.mm_hidden)
        counts = seq.mm_mask[:len(hashes) * bs].view(-1, bs).sum(-1).tolist()
        start = sum(counts[:done])
        for i in range(done, len(hashes)):
            if counts[i]:
                extra[i] = rows[start:start + counts[i]].clone()
            start += counts[i]
    blocks.register(seq.req.request_id, hashes, extra)
