"""The thinker's inputs. At admission (`encode_together`, `new_seq`): the encoders, each kind of media of all newly admitted
requests in one encoder call (audio tower; vision encoder for images, then for videos, as transformers
encodes them), the prompt embeddings with encoder rows scattered in, DeepStack rows and 3-D positions.
Per step (`step_deepstack`): the DeepStack rows that fall in the step's prefill chunks."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from omnistage.engine.detokenizer import IncrementalDetokenizer
from omnistage.engine.request import Request
from omnistage.models.qwen3_omni.decoder import Deepstack
from omnistage.models.qwen3_omni.encoders import VisualEmbeds
from omnistage.models.qwen3_omni.prompt import PromptInputs
from omnistage.models.qwen3_omni.rope_index import RopeSpec, mrope_positions
from omnistage.pipeline.faults import together
from omnistage.pipeline.thinker.seq import ThinkerSeq


def _encode_audio(thinker: torch.nn.Module, prompts: list[PromptInputs], device: torch.device,
                  dtype: torch.dtype) -> list[torch.Tensor | None]:
    """Audio token rows per prompt (None without audio): one audio-tower call for all prompts."""
    have = [p for p in prompts if p.input_features is not None]
    if not have:
        return [None] * len(prompts)
    width = max(p.input_features.shape[-1] for p in have)
    feats = torch.cat([F.pad(p.input_features, (0, width - p.input_features.shape[-1])) for p in have])
    mask = torch.cat([F.pad(p.feature_attention_mask, (0, width - p.feature_attention_mask.shape[-1]))
                      for p in have])
    rows = thinker.encode_audio(feats.to(device, dtype), mask.to(device))
    parts = iter(rows.split([p.input_ids.count(thinker.audio_token_id) for p in have]))
    return [next(parts) if p.input_features is not None else None for p in prompts]


def _encode_visual(thinker: torch.nn.Module, pixels: list[torch.Tensor | None], grids: list[torch.Tensor | None],
                   device: torch.device) -> list[VisualEmbeds | None]:
    """Merged rows and DeepStack rows per prompt (None without this media): one vision-encoder call."""
    have = [i for i, g in enumerate(grids) if g is not None]
    out: list[VisualEmbeds | None] = [None] * len(grids)
    if not have:
        return out
    enc = thinker.encode_visual(torch.cat([pixels[i] for i in have]).to(device),
                                torch.cat([grids[i] for i in have]).to(device))
    counts = [int(grids[i].prod(-1).sum()) // thinker.visual.spatial_merge_size**2 for i in have]
    levels = [level.split(counts) for level in enc.deepstack]
    for j, (i, rows) in enumerate(zip(have, enc.embeds.split(counts))):
        out[i] = VisualEmbeds(rows, [level[j] for level in levels])
    return out


Media = tuple[torch.Tensor | None, VisualEmbeds | None, VisualEmbeds | None]  # audio, image, video rows


def encode_media(thinker: torch.nn.Module, prompts: list[PromptInputs], device: torch.device,
                 dtype: torch.dtype) -> list[Media]:
    """Encoder rows of each prompt; each kind of media of all prompts in one encoder call."""
    audios = _encode_audio(thinker, prompts, device, dtype)
    images = _encode_visual(thinker, [p.pixel_values for p in prompts], [p.image_grid_thw for p in prompts], device)
    videos = _encode_visual(thinker, [p.pixel_values_videos for p in prompts], [p.video_grid_thw for p in prompts],
                            device)
    return list(zip(audios, images, videos))


def encode_together(thinker: torch.nn.Module, prompts: list[PromptInputs], device: torch.device,
                    dtype: torch.dtype) -> list[Media] | None:
    """`encode_media` for several prompts at once; None for a single prompt or when it fails (each
    request is then encoded alone, so that only the one at fault fails)."""
    return together(encode_media, thinker, prompts, device, dtype) if len(prompts) > 1 else None


def new_seq(thinker: torch.nn.Module, req: Request, media: Media, tokenizer: Any, spec: RopeSpec) -> ThinkerSeq:
    """A request's thinker state: prompt embeddings with its encoder rows, DeepStack rows, positions."""
    p, device = req.prompt, next(thinker.parameters()).device
    # NOTE: ids and their mask stay on the host: on the device, `has_mm` (and the talker's prompt masks)
    # would each sync with the step in flight; only the embedding lookup reads them there.
    ids = torch.tensor(p.input_ids)
    embeds, deepstack = thinker.embed(ids.to(device, non_blocking=True), *media)
    mm = torch.isin(ids, torch.tensor([thinker.audio_token_id, thinker.image_token_id, thinker.video_token_id]))
    mrope = mrope_positions(p.input_ids, spec, p.image_grid_thw, p.video_grid_thw, p.video_second_per_grid,
                            p.audio_feature_lens, p.use_audio_in_video)
    return ThinkerSeq(req, ids, embeds, mm, IncrementalDetokenizer(tokenizer, p.input_ids), has_mm=bool(mm.any()),
                      mrope=mrope, deepstack=deepstack)


def step_deepstack(batch: list[tuple[ThinkerSeq, int]]) -> Deepstack | None:
    """DeepStack rows of a flat step (`batch`: (seq, new rows) in row order, before `num_computed`
    advances): each prefill chunk's visual rows, at their flat row indices."""
    index, levels, offset = [], [], 0
    for seq, n in batch:
        ds, c = seq.deepstack, seq.num_computed
        if ds is not None and seq.in_prefill:
            keep = (ds.index >= c) & (ds.index < c + n)
            index.append(ds.index[keep] - c + offset)
            levels.append([level[keep] for level in ds.embeds])
        offset += n
    if not index or sum(i.numel() for i in index) == 0:
        return None
    return Deepstack(torch.cat(index), [torch.cat(rows) for rows in zip(*levels)])
