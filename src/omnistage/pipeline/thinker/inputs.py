"""The thinker's inputs. At admission (`encode_together`, `new_seq`): the encoders, each kind of media of all newly
admitted requests in one encoder call (audio tower; vision encoder for images, then for videos, as transformers
encodes them), the prompt embeddings with encoder rows scattered in, DeepStack rows and 3-D positions.
Per step (`step_deepstack`): the DeepStack rows that fall in the step's prefill chunks."""

from __future__ import annotations

from typing import Any

import torch

from omnistage.engine.detokenizer import IncrementalDetokenizer
from omnistage.engine.request import Request
from omnistage.models.qwen3_omni.audio_encoder import audio_forward
from omnistage.models.qwen3_omni.decoder import Deepstack
from omnistage.models.qwen3_omni.encoders import VisualEmbeds
from omnistage.models.qwen3_omni.prompt import PromptInputs
from omnistage.models.qwen3_omni.rope_index import RopeSpec, audio_token_count, mrope_positions
from omnistage.pipeline.faults import together
from omnistage.pipeline.thinker.audio_graph import AudioGraphRunner
from omnistage.pipeline.thinker.encoder_cache import EncoderCache, join_visual, split_visual
from omnistage.pipeline.thinker.seq import ThinkerSeq
from omnistage.pipeline.thinker.vision_graph import VisionGraphRunner


def _keys(p: PromptInputs, kind: str, n: int) -> tuple[bytes | None, ...]:
    keys = getattr(p.media_keys, kind) if p.media_keys is not None else ()
    return keys if len(keys) == n else (None,) * n


def _cached(cache: EncoderCache | None, keys: list[bytes | None]) -> list[Any]:
    return [cache.get(k) if cache is not None else None for k in keys]


def audio_rows(tower: torch.nn.Module, feats: list[torch.Tensor], lens: list[int], device: torch.device,
               dtype: torch.dtype, audio: AudioGraphRunner | None) -> tuple[torch.Tensor, ...]:
    """Each clip's rows: one eager audio-tower call, or runs of `audio` (a clip too long for one eagerly)."""
    parts = []
    for run in audio.groups(lens) if audio is not None else [range(len(lens))]:
        x, n = torch.cat([feats[j] for j in run], dim=1), [lens[j] for j in run]
        parts.append(audio.run(x, n) if audio is not None and audio.fits(n) else
                     audio_forward(tower, x.to(device, dtype, non_blocking=True), n))
    return torch.cat(parts).split([audio_token_count(n, tower.config.n_window) for n in lens])


def _encode_audio(thinker: torch.nn.Module, prompts: list[PromptInputs], device: torch.device,
                  dtype: torch.dtype, cache: EncoderCache | None,
                  audio: AudioGraphRunner | None = None) -> list[torch.Tensor | None]:
    """Audio token rows per prompt (None without audio): the audios no cache holds in one audio-tower call
    (in runs of `audio`'s graphs where given)."""
    items = [(j, f[:, :n], n) for j, p in enumerate(prompts) if p.input_features is not None
             for f, n in zip(p.input_features, p.audio_feature_lens)]
    if not items:
        return [None] * len(prompts)
    keys = [k for p in prompts if p.input_features is not None
            for k in _keys(p, "audios", p.input_features.shape[0])]
    rows = _cached(cache, keys)
    todo = [i for i, r in enumerate(rows) if r is None]
    if todo:
        out = audio_rows(thinker.audio_tower, [items[i][1] for i in todo], [items[i][2] for i in todo], device,
                         dtype, audio)
        for i, r in zip(todo, out):
            rows[i] = r
            if cache is not None:
                cache.put(keys[i], r.clone())
    per = [[r for (j, _, _), r in zip(items, rows) if j == k] for k in range(len(prompts))]
    return [torch.cat(r) if r else None for r in per]


def _visual_rows(thinker: torch.nn.Module, pixels: list[torch.Tensor], grids: list[torch.Tensor],
                 device: torch.device, vision: VisionGraphRunner | None) -> VisualEmbeds:
    """The items' rows: one eager vision-encoder call, or runs of `vision` (an item too large for one eagerly)."""
    if vision is None:
        return thinker.encode_visual(torch.cat(pixels).to(device, non_blocking=True), torch.stack(grids))
    lists, parts = [g.tolist() for g in grids], []
    for run in vision.groups(lists):
        px, gs = [pixels[j] for j in run], [lists[j] for j in run]
        parts.append(vision.run(px, gs) if vision.fits(gs) else
                     thinker.encode_visual(torch.cat(px).to(device, non_blocking=True), torch.tensor(gs)))
    return join_visual(parts)


def _encode_visual(thinker: torch.nn.Module, pixels: list[torch.Tensor | None], grids: list[torch.Tensor | None],
                   keys: list[tuple[bytes | None, ...]], device: torch.device, cache: EncoderCache | None,
                   vision: VisionGraphRunner | None) -> list[VisualEmbeds | None]:
    """Merged rows and DeepStack rows per prompt (None without this media): the items no cache holds in one
    vision-encoder call."""
    merge = thinker.visual.spatial_merge_size**2
    items = [(j, px, g) for j, (p, gs) in enumerate(zip(pixels, grids)) if gs is not None
             for px, g in zip(p.split(gs.prod(-1).tolist()), gs)]
    if not items:
        return [None] * len(grids)
    flat_keys = [k for j, gs in enumerate(grids) if gs is not None for k in keys[j]]
    rows = _cached(cache, flat_keys)
    todo = [i for i, r in enumerate(rows) if r is None]
    if todo:
        enc = _visual_rows(thinker, [items[i][1] for i in todo], [items[i][2] for i in todo], device, vision)
        for i, r in zip(todo, split_visual(enc, [int(items[i][2].prod()) // merge for i in todo])):
            rows[i] = r
            if cache is not None:
                cache.put(flat_keys[i], VisualEmbeds(r.embeds.clone(), [d.clone() for d in r.deepstack]))
    per = [[r for (j, _, _), r in zip(items, rows) if j == k] for k in range(len(grids))]
    return [join_visual(r) if r else None for r in per]


Media = tuple[torch.Tensor | None, VisualEmbeds | None, VisualEmbeds | None]  # audio, image, video rows


def encode_media(thinker: torch.nn.Module, prompts: list[PromptInputs], device: torch.device,
                 dtype: torch.dtype, cache: EncoderCache | None = None, vision: VisionGraphRunner | None = None,
                 audio: AudioGraphRunner | None = None) -> list[Media]:
    """Encoder rows of each prompt; each kind of media of all prompts in one encoder call (what `cache`
    holds is not encoded again; images and videos in runs of `vision`'s graphs, audio in `audio`'s, where
    given)."""
    audios = _encode_audio(thinker, prompts, device, dtype, cache, audio)
    images = _encode_visual(thinker, [p.pixel_values for p in prompts], [p.image_grid_thw for p in prompts],
                            [_keys(p, "images", _count(p.image_grid_thw)) for p in prompts], device, cache, vision)
    videos = _encode_visual(thinker, [p.pixel_values_videos for p in prompts], [p.video_grid_thw for p in prompts],
                            [_keys(p, "videos", _count(p.video_grid_thw)) for p in prompts], device, cache, vision)
    return list(zip(audios, images, videos))


def warm_encoders(thinker: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Run the audio tower (clips of 1, 2, 4, ... 64 s: every conv batch up to 64 chunks, see `audio_forward`)
    and the vision encoder (a 640 x 480 photo, a 4-frame 320 x 240 video) once, at start, so that the first
    media request does not pay their first calls."""
    mels = thinker.audio_tower.config.num_mel_bins
    for frames in (100 << k for k in range(7)):
        thinker.encode_audio(torch.zeros(1, mels, frames, device=device, dtype=dtype),
                             torch.ones(1, frames, dtype=torch.long))
    v = thinker.visual.config
    for grid in ([1, 30, 40], [2, 16, 20]):
        rows = grid[0] * grid[1] * grid[2]
        width = v.in_channels * v.temporal_patch_size * v.patch_size**2
        thinker.encode_visual(torch.zeros(rows, width, device=device, dtype=dtype),
                              torch.tensor([grid]))


def _count(grids: torch.Tensor | None) -> int:
    return 0 if grids is None else grids.shape[0]


def encode_together(thinker: torch.nn.Module, prompts: list[PromptInputs], device: torch.device,
                    dtype: torch.dtype, cache: EncoderCache | None = None, vision: VisionGraphRunner | None = None,
                    audio: AudioGraphRunner | None = None) -> list[Media] | None:
    """`encode_media` for several prompts at once; None for a single prompt or when it fails (each
    request is then encoded alone, so that only the one at fault fails)."""
    return together(encode_media, thinker, prompts, device, dtype, cache, vision, audio) if len(prompts) > 1 \
        else None


def new_seq(thinker: torch.nn.Module, req: Request, prompt: PromptInputs, media: Media, tokenizer: Any,
            spec: RopeSpec) -> ThinkerSeq:
    """A request's thinker state from `prompt` (the one `media` was encoded from: a growing request's
    `req.prompt` may be replaced meanwhile): prompt embeddings with its encoder rows, DeepStack rows, positions."""
    p, device = prompt, next(thinker.parameters()).device
    # NOTE: ids and their mask stay on the host: on the device, `has_mm` (and the talker's prompt masks)
    # would each sync with the step in flight; only the embedding lookup reads them there.
    ids = torch.tensor(p.input_ids)
    embeds, deepstack = thinker.embed(ids.to(device, non_blocking=True), *media, host_ids=ids)
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
