"""The talker's prompt at the thinker's admission (deploy `connector.talker_prompt_at_admission`).

A talker prompt's rows are its user turns' text rows, then 9 assistant rows of which only the last holds the first
generated token (models/qwen3_omni/talker_prompt_rows.py). So all but that row are known once the thinker has
admitted a request: sent then, the talker prefills them beside the thinker's prefill and takes one row, a decode
step, at the first token (pipeline/talker/admission.py). Text prompts only: a multimodal position's talker row is an
accept-layer hidden row, which the thinker's prefill makes; a growing prompt (realtime) is not final yet."""

from __future__ import annotations

import torch

from omnistage.pipeline.connector import TalkerPrompt, TextChunk
from omnistage.pipeline.thinker.seq import ThinkerSeq


def early_prompt(seq: ThinkerSeq) -> TextChunk | None:
    """The talker's prompt of a request just admitted, where it can go now; else None."""
    if not seq.req.want_audio or seq.has_mm or seq.open:
        return None
    ready = None
    if seq.embeds.is_cuda:  # NOTE: no host sync orders the embeddings before the talker's stream reads them
        ready = torch.cuda.Event()
        ready.record()
    return TextChunk(seq.req, prompt=TalkerPrompt(seq.prompt_ids, seq.embeds, None, ready))
