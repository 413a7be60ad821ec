"""The talker's prompt rows (as transformers builds them), for many requests at once.

The user turns (text positions -> text_projection(embedding), multimodal positions ->
hidden_projection(accept-layer hidden)); system and earlier assistant turns are dropped. Then 9
assistant rows, text side + codec side:
  <|im_start|> assistant \\n | 4 x tts_pad + nothink, think_bos, think_eos, speaker | tts_bos + codec_pad |
  first generated token + codec_bos.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from omnistage.models.qwen3_omni.talker_prompt import TalkerTokens, multimodal_mask, user_mask

ASSISTANT_ROWS = 9  # a prompt's rows after its user turns (the layout above)


def assistant_start(prompt_ids: torch.Tensor, tokens: TalkerTokens) -> int:
    """Index of the last `<|im_start|>assistant` of the prompt with its 3 head rows (`\\n` the third)."""
    hits = ((prompt_ids[:-2] == tokens.im_start) & (prompt_ids[1:-1] == tokens.assistant)).nonzero()
    if hits.numel() == 0:
        raise ValueError("the prompt has no '<|im_start|>assistant' turn to speak")
    return int(hits[-1, 0])


@dataclass(frozen=True)
class PromptSource:
    """One request's inputs to its talker prompt, checked on the host (`prompt_source`)."""

    prompt_ids: torch.Tensor  # [L] host
    thinker_embeds: torch.Tensor  # [L, Ht] the thinker's input embeddings of the prompt
    mm_hidden: torch.Tensor | None  # [M, Ht] accept-layer hidden rows at the prompt's M multimodal positions
    first_embed: torch.Tensor  # [Ht] thinker input embedding of the first generated token
    head: int  # `assistant_start`
    speaker: int  # the voice's codec id


def prompt_source(tokens: TalkerTokens, prompt_ids: torch.Tensor, thinker_embeds: torch.Tensor,
                  mm_hidden: torch.Tensor | None, first_embed: torch.Tensor, speaker: str) -> PromptSource:
    """A request's `PromptSource`; ValueError when no talker prompt can be built from it. `prompt_ids` [L]
    stay on the host (the stage keeps them there): the masks are computed beside them, with no device sync."""
    head, mm = assistant_start(prompt_ids, tokens), multimodal_mask(prompt_ids, tokens)
    if (bool(mm.any()) and (mm_hidden is None or mm_hidden.shape[0] != int(mm.sum()))
            and bool((user_mask(prompt_ids, tokens) & mm).any())):
        raise ValueError(f"need accept-layer hidden rows for all {int(mm.sum())} multimodal positions")
    return PromptSource(prompt_ids, thinker_embeds, mm_hidden, first_embed, head, tokens.speaker_id(speaker))


def _runs(tensors: Sequence[torch.Tensor | None], mask: torch.Tensor, seg: torch.Tensor) -> list[torch.Tensor]:
    """Views of the rows of `tensors` (concatenated; `seg`: the tensor of each row) where the host `mask`
    holds, one view per run of rows."""
    joined = mask[1:] & mask[:-1] & (seg[1:] == seg[:-1])  # rows t and t + 1 in one run
    no = torch.zeros(1, dtype=torch.bool)
    starts = (mask & ~torch.cat([no, joined])).nonzero()[:, 0]
    ends = (mask & ~torch.cat([joined, no])).nonzero()[:, 0] + 1
    counts = torch.bincount(seg, minlength=len(tensors))
    which = seg[starts]
    base = (counts.cumsum(0) - counts)[which]
    return [tensors[i][s:e] for i, s, e in zip(which.tolist(), (starts - base).tolist(), (ends - base).tolist())]


def _row_order(keep: torch.Tensor, mm: torch.Tensor, text: torch.Tensor, seg: torch.Tensor, heads: torch.Tensor,
               n_mm: int) -> tuple[torch.Tensor, list[int]]:
    """Host gather index of the prompt rows of all requests, in order, from [projected text rows (position
    order), projected first tokens, projected kept multimodal rows, 6 assistant tail rows per request];
    and each request's number of rows."""
    n, n_text = heads.shape[0], int(text.sum())
    text_row = text.cumsum(0) - 1
    mm_row = (keep & mm).cumsum(0) - 1 + n_text + n
    user_seg = seg[keep]
    counts = torch.bincount(user_seg, minlength=n)
    tail = n_text + n + n_mm + torch.arange(6 * n).view(n, 6)
    order = torch.empty(user_seg.numel() + 9 * n, dtype=torch.long)
    order[torch.arange(user_seg.numel()) + 9 * user_seg] = torch.where(mm, mm_row, text_row)[keep]
    ends = counts.cumsum(0) + 9 * torch.arange(n)  # each request's first assistant row
    order[ends[:, None] + torch.arange(9)] = torch.cat([text_row[heads], tail], 1)
    return order, (counts + 9).tolist()


def prompt_embeds_batch(talker: nn.Module, tokens: TalkerTokens, sources: Sequence[PromptSource]
                        ) -> list[torch.Tensor]:
    """The talker's prefill rows [Lu_i + 9, H] (positions 0..Lu_i+8) of many requests, views of one tensor:
    one text_projection for all their user-turn text rows, assistant heads and first tokens, one
    hidden_projection for all their multimodal rows, one codec lookup and one host-to-device index copy."""
    n, ids = len(sources), torch.cat([s.prompt_ids for s in sources])
    lens = torch.tensor([s.prompt_ids.numel() for s in sources])
    seg = torch.repeat_interleave(torch.arange(n), lens)
    keep, mm = user_mask(ids, tokens, lens), multimodal_mask(ids, tokens)
    heads = (lens.cumsum(0) - lens + torch.tensor([s.head for s in sources]))[:, None] + torch.arange(3)
    text = keep & ~mm
    text[heads.flatten()] = True
    rows = _runs([s.thinker_embeds for s in sources], text, seg) + [s.first_embed[None] for s in sources]
    parts = [talker.text_projection(torch.cat(rows))]
    kept_mm = keep[mm]
    if bool(kept_mm.any()):
        hidden = _runs([s.mm_hidden for s in sources], kept_mm, seg[mm])
        parts.append(talker.hidden_projection(torch.cat(hidden)))
    order, sizes = _row_order(keep, mm, text, seg, heads, int(kept_mm.sum()))
    codec_ids = torch.tensor([[tokens.codec_nothink, tokens.codec_think_bos, tokens.codec_think_eos, s.speaker,
                               tokens.codec_pad, tokens.codec_bos] for s in sources])
    # NOTE: one non-blocking copy from host tensors: a blocking one would wait for the step in flight.
    index = torch.cat([order, codec_ids.flatten()]).to(parts[0].device, non_blocking=True)
    bos, _, pad = talker.tts_embeds
    tail = torch.cat([pad.expand(n, 4, -1), bos.expand(n, 1, -1), parts[0][-n:, None]], 1)
    parts.append((tail + talker.model.codec_embedding(index[order.numel():].view(n, 6))).flatten(0, 1))
    return list(torch.cat(parts).index_select(0, index[:order.numel()]).split(sizes))


def first_token_row(talker: nn.Module, tokens: TalkerTokens, first_embed: torch.Tensor) -> torch.Tensor:
    """A prompt's last row [1, H] (the first generated token + codec_bos), as `prompt_embeds_batch` makes it, for
    a prompt whose other rows were built before the first token (its placeholder row dropped)."""
    # NOTE: the weight's row, not a lookup of a host id: that copy would wait for the talker's step in flight
    return talker.text_projection(first_embed[None]) + talker.model.codec_embedding.weight[tokens.codec_bos]


def prompt_embeds(talker: nn.Module, tokens: TalkerTokens, prompt_ids: torch.Tensor, thinker_embeds: torch.Tensor,
                  mm_hidden: torch.Tensor | None, first_embed: torch.Tensor, speaker: str) -> torch.Tensor:
    """One request's `prompt_embeds_batch` (see `prompt_source` for the arguments)."""
    source = prompt_source(tokens, prompt_ids, thinker_embeds, mm_hidden, first_embed, speaker)
    return prompt_embeds_batch(talker, tokens, [source])[0]
