"""The talker's input rows, built from what the thinker has seen and said (as transformers does).

Streaming contract: the first payload is the prompt (its token ids, the thinker's input embeddings of
the prompt, the accept-layer hidden rows at its multimodal positions) plus the first generated token;
from then on the talker takes ONE text row per codec frame (`next_text_row`): generated token j+1,
`tts_eos` in place of the thinker's final token, then `tts_pad` for ever.

Prompt rows: the user turns (text positions -> text_projection(embedding), multimodal positions ->
hidden_projection(accept-layer hidden)); system and earlier assistant turns are dropped. Then 9
assistant rows, text side + codec side:
  <|im_start|> assistant \\n | 4 x tts_pad + nothink, think_bos, think_eos, speaker | tts_bos + codec_pad |
  first generated token + codec_bos.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from omnistage.models.qwen3_omni.prompt import PromptInputs
from omnistage.models.qwen3_omni.rope_index import MRope, RopeSpec, mrope_positions


@dataclass(frozen=True)
class TalkerTokens:
    """Thinker-vocab ids that shape the prompt and the talker's codec-vocab specials."""

    im_start: int
    user: int
    assistant: int
    multimodal: tuple[int, ...]
    codec_nothink: int
    codec_think_bos: int
    codec_think_eos: int
    codec_pad: int
    codec_bos: int
    speakers: dict[str, int]
    tts_pad: int = 0
    rope: RopeSpec | None = None  # the talker's position rule (3-D with images / videos)

    @classmethod
    def from_config(cls, config) -> TalkerTokens:
        """From a `Qwen3OmniMoeConfig` (top level)."""
        th, tk = config.thinker_config, config.talker_config
        return cls(
            im_start=config.im_start_token_id, user=config.user_token_id, assistant=config.assistant_token_id,
            multimodal=(th.audio_token_id, th.image_token_id, th.video_token_id),
            codec_nothink=tk.codec_nothink_id, codec_think_bos=tk.codec_think_bos_id,
            codec_think_eos=tk.codec_think_eos_id, codec_pad=tk.codec_pad_id, codec_bos=tk.codec_bos_id,
            speakers={k.lower(): v for k, v in tk.speaker_id.items()}, tts_pad=config.tts_pad_token_id,
            rope=RopeSpec.from_config(config, "talker"),
        )

    def speaker_id(self, speaker: str) -> int:
        try:
            return self.speakers[speaker.lower()]
        except KeyError:
            raise ValueError(f"unknown voice {speaker!r}; choose from {sorted(self.speakers)}") from None


def user_mask(prompt_ids: torch.Tensor, tokens: TalkerTokens) -> torch.Tensor:
    """[L] bool: positions whose latest `<|im_start|>` (at or before them) opens a user turn."""
    pos = torch.arange(prompt_ids.numel(), device=prompt_ids.device)
    starts = torch.where(prompt_ids == tokens.im_start, pos, torch.full_like(pos, -1))
    # NOTE: positions before any <|im_start|> read the role after position 0, as transformers does.
    role_at = (starts.cummax(0).values.clamp_min(0) + 1).clamp_max(prompt_ids.numel() - 1)
    return prompt_ids[role_at] == tokens.user


def assistant_start(prompt_ids: torch.Tensor, tokens: TalkerTokens) -> int:
    """Index of the last `<|im_start|>assistant` of the prompt."""
    hits = ((prompt_ids[:-1] == tokens.im_start) & (prompt_ids[1:] == tokens.assistant)).nonzero()
    if hits.numel() == 0:
        raise ValueError("the prompt has no '<|im_start|>assistant' turn to speak")
    return int(hits[-1, 0])


def user_rows(talker: nn.Module, tokens: TalkerTokens, prompt_ids: torch.Tensor, thinker_embeds: torch.Tensor,
              mm_hidden: torch.Tensor | None) -> torch.Tensor:
    """Talker rows of the user turns. `thinker_embeds` [L, Ht]: the thinker's input embeddings of the
    prompt; `mm_hidden` [M, Ht]: accept-layer hidden rows at the prompt's M multimodal positions.
    `prompt_ids` may stay on the host (the stage keeps them there): the masks are computed beside them."""
    keep = user_mask(prompt_ids, tokens)
    mm = torch.isin(prompt_ids, torch.tensor(tokens.multimodal, device=prompt_ids.device))

    def rows(mask: torch.Tensor) -> torch.Tensor:  # NOTE: no host sync when the ids are on the host
        return mask.nonzero()[:, 0].to(thinker_embeds.device, non_blocking=True)

    out = thinker_embeds.new_empty(int(keep.sum()), talker.text_projection.linear_fc2.out_features)
    out.index_copy_(0, rows(~mm[keep]), talker.text_projection(thinker_embeds.index_select(0, rows(keep & ~mm))))
    if bool((keep & mm).any()):
        if mm_hidden is None or mm_hidden.shape[0] != int(mm.sum()):
            raise ValueError(f"need accept-layer hidden rows for all {int(mm.sum())} multimodal positions")
        out.index_copy_(0, rows(mm[keep]), talker.hidden_projection(mm_hidden.index_select(0, rows(keep[mm]))))
    return out


def assistant_rows(talker: nn.Module, tokens: TalkerTokens, head_embeds: torch.Tensor, first_text: torch.Tensor,
                   speaker: str) -> torch.Tensor:
    """The 9 assistant rows. `head_embeds` [3, Ht]: thinker embeddings of `<|im_start|>assistant\\n`;
    `first_text` [H]: the talker row of the first generated token (see `next_text_row`)."""
    bos, _, pad = talker.tts_embeds
    text = torch.cat([talker.text_projection(head_embeds), pad.expand(4, -1), bos[None], first_text[None]])
    codec_ids = [tokens.codec_nothink, tokens.codec_think_bos, tokens.codec_think_eos, tokens.speaker_id(speaker),
                 tokens.codec_pad, tokens.codec_bos]
    codec = talker.model.codec_embedding(torch.tensor(codec_ids).to(text.device, non_blocking=True))
    return text + torch.cat([codec.new_zeros(3, codec.shape[1]), codec])


def prompt_embeds(talker: nn.Module, tokens: TalkerTokens, prompt_ids: torch.Tensor, thinker_embeds: torch.Tensor,
                  mm_hidden: torch.Tensor | None, first_text: torch.Tensor, speaker: str) -> torch.Tensor:
    """The talker's prefill rows [Lu + 9, H] (positions 0..Lu+8)."""
    a = assistant_start(prompt_ids, tokens)
    users = user_rows(talker, tokens, prompt_ids, thinker_embeds, mm_hidden)
    return torch.cat([users, assistant_rows(talker, tokens, thinker_embeds[a:a + 3], first_text, speaker)])


def prompt_mrope(tokens: TalkerTokens, prompt_ids: torch.Tensor, prompt: PromptInputs) -> MRope | None:
    """3-D positions of the talker prompt (None: 1-D), as transformers computes them: over the user-turn
    ids and 9 `tts_pad` ids, with all the request's image / video grids and audio lengths. NOTE: never
    with use_audio_in_video (transformers does not pass it on to the talker), so a video with its
    audio track reads as an audio there; the talker's decode then goes on at index + delta."""
    if prompt.image_grid_thw is None and prompt.video_grid_thw is None:
        return None
    ids = prompt_ids[user_mask(prompt_ids, tokens)].tolist() + [tokens.tts_pad] * 9
    return mrope_positions(ids, tokens.rope, prompt.image_grid_thw, prompt.video_grid_thw,
                           prompt.video_second_per_grid, prompt.audio_feature_lens)


def next_text_row(talker: nn.Module, thinker_embed: torch.Tensor | None, final: bool = False) -> torch.Tensor:
    """The talker row [H] for one generated thinker token (its thinker input embedding [Ht]): the
    thinker's final token (`final`, embedding not needed) is never spoken and becomes `tts_eos`; no token
    at all (the text is done) is `tts_pad`."""
    return text_rows(talker, [thinker_embed], [final])[0]


def text_rows(talker: nn.Module, thinker_embeds: list[torch.Tensor | None], finals: list[bool]) -> torch.Tensor:
    """`next_text_row` for many requests at once [N, H], with one projection for all their tokens."""
    bos_eos_pad = talker.tts_embeds
    dev = bos_eos_pad.device
    # NOTE: indices reach the device without a blocking copy (a blocking one waits for the whole stream,
    # which would stall the talker's asynchronous output behind the step in flight).
    eos = torch.tensor(finals).to(dev, non_blocking=True)
    rows = torch.where(eos[:, None], bos_eos_pad[1], bos_eos_pad[2])
    text = [i for i, (e, f) in enumerate(zip(thinker_embeds, finals)) if e is not None and not f]
    if text:
        projected = talker.text_projection(torch.stack([thinker_embeds[i] for i in text])).to(rows.dtype)
        rows = rows.index_copy(0, torch.tensor(text).to(dev, non_blocking=True), projected)
    return rows
