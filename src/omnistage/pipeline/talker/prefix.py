"""The talker's use of the prefix cache (engine/block_manager.py): every user turn of a conversation comes back
in the next turn's talker prompt, so the full KV blocks of a prompt's user-turn rows are kept once computed and
taken again by a later prompt with the same history.

A talker row at a user position p is decided by the thinker's prompt up to p (its token, or the accept-layer row
of its audio / image / video, computed over everything before it: the system turn and earlier answers too,
which the talker's rows drop). So block b of the user rows is keyed by b and the hash of the thinker's prompt
up to the end of the block (of the same size) that holds its last row's position
(`prefix_hash.block_hashes` over the thinker's ids and media keys). The 9 assistant rows (voice, first token)
are never cached.
"""

from __future__ import annotations

import hashlib

import torch

from omnistage.engine.block_manager import BlockManager
from omnistage.engine.prefix_hash import block_hashes
from omnistage.models.qwen3_omni.prompt import PromptInputs
from omnistage.models.qwen3_omni.talker_prompt import TalkerTokens, user_mask
from omnistage.pipeline.talker.seq import TalkerSeq


def prompt_hashes(prompt_ids: torch.Tensor, prompt: PromptInputs, tokens: TalkerTokens, block_size: int,
                  has_mm: bool) -> list[bytes] | None:
    """The keys of the talker prompt's full blocks of user rows (host `prompt_ids`: the thinker's); None where
    its media have no keys."""
    keys = prompt.media_keys
    if has_mm and keys is None:
        return None
    thinker = block_hashes(prompt_ids.tolist(), block_size, keys.spans if keys is not None else ())
    users = user_mask(prompt_ids, tokens).nonzero()[:, 0].tolist()
    out = []
    for b in range(len(users) // block_size):
        j = users[(b + 1) * block_size - 1] // block_size
        if j >= len(thinker):  # NOTE: its thinker block is not full yet: that prefix is not final
            break
        out.append(hashlib.blake2b(thinker[j], digest_size=16, salt=b.to_bytes(16, "little")).digest())
    return out


def take_prefix(blocks: BlockManager, seq: TalkerSeq, user_rows: int) -> None:
    """The prompt's cached blocks, once, before it is first scheduled: those rows are not prefilled again."""
    if seq.block_hashes is None or seq.cached_blocks >= 0:
        return
    taken = blocks.match(seq.req.request_id, seq.block_hashes, user_rows)
    seq.cached_blocks, seq.num_computed = len(taken), len(taken) * blocks.block_size


def register_prefix(blocks: BlockManager, seq: TalkerSeq) -> None:
    """The prompt's user-row blocks, computed by the step just launched (later steps read them after it)."""
    hashes, seq.block_hashes = seq.block_hashes, None
    if hashes:
        blocks.register(seq.req.request_id, hashes)
