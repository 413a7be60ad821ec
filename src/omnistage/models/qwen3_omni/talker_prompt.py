"""The talker's input rows, built from what the thinker has seen and said (as transformers does).

Streaming contract: the first payload is the prompt (its token ids, the thinker's input embeddings of
the prompt, the accept-layer hidden rows at its multimodal positions) plus the first generated token;
from then on the talker takes ONE text row per codec frame (`next_text_row`): generated token j+1,
`tts_eos` in place of the thinker's final token, then `tts_pad` for ever. The prompt rows themselves:
`talker_prompt_rows`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from omnistage.layers.context import to_device
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


def user_mask(prompt_ids: torch.Tensor, tokens: TalkerTokens, lens: torch.Tensor | None = None) -> torch.Tensor:
    """[L] bool: positions whose latest `<|im_start|>` (at or before them) opens a user turn. `lens`: host
    `prompt_ids` are several prompts of these lengths, concatenated (default: one prompt)."""
    lens = torch.tensor([prompt_ids.numel()]) if lens is None else lens
    first = lens.cumsum(0) - lens
    pos = torch.arange(prompt_ids.numel())
    starts = torch.where(prompt_ids == tokens.im_start, pos, -1)
    # NOTE: positions before any <|im_start|> read the role after position 0, as transformers does.
    starts[first] = first
    role_at = torch.minimum(starts.cummax(0).values + 1, torch.repeat_interleave(first + lens - 1, lens))
    return prompt_ids[role_at] == tokens.user


def multimodal_mask(prompt_ids: torch.Tensor, tokens: TalkerTokens) -> torch.Tensor:
    """[L] bool: audio / image / video positions."""
    return torch.isin(prompt_ids, torch.tensor(tokens.multimodal))


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
    eos = to_device(finals, torch.bool, dev)
    rows = torch.where(eos[:, None], bos_eos_pad[1], bos_eos_pad[2])
    text = [i for i, (e, f) in enumerate(zip(thinker_embeds, finals)) if e is not None and not f]
    if text:
        projected = talker.text_projection(torch.stack([thinker_embeds[i] for i in text])).to(rows.dtype)
        rows = rows.index_copy(0, to_device(text, torch.long, dev), projected)
    return rows
