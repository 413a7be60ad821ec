"""The vision encoder's forward (patches + learned positions resampled to each grid, 2-D rotary attention
blocks over each image / video frame, DeepStack mergers) over transformers' `Qwen3OmniMoeVisionEncoder`
modules and weights, with the position, resampling and sequence indices computed on the host from the grids:
no host sync inside.

transformers' own forward (the reference, `tests/test_encoder_attention.py`: equal on the CPU) derives them
from the device's `grid_thw`, syncing on it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import apply_rotary_pos_emb_vision

from omnistage.models.qwen3_omni.encoder_attention import packed_attention


def _taps(index: torch.Tensor, size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear taps (align_corners) into a `side`-long table and their weights for positions `index` of an axis
    of `size`, in transformers' arithmetic (`vision_utils._interpolation_axis_taps_weights`)."""
    src = index.to(torch.float32) * (side - 1) / max(size - 1, 1)
    floor = torch.floor(src)
    offsets = torch.arange(0, 2)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    return taps, (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)


def _grid_layout(t: int, h: int, w: int, merge: int, side: int) -> tuple[torch.Tensor, ...]:
    """One image / video's (h, w) patch positions in merge-block order `[t*h*w, 2]`, and its resampling
    indices and weights into the learned `side x side` position table `[t*h*w, 4]`."""
    rows = torch.arange(h)[:, None].expand(h, w)
    cols = torch.arange(w)[None, :].expand(h, w)
    shape = (h // merge, merge, w // merge, merge)
    row, col = (x.reshape(shape).transpose(1, 2).flatten() for x in (rows, cols))
    (h_taps, h_weights), (w_taps, w_weights) = _taps(row, h, side), _taps(col, w, side)
    index = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
    weight = (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 4)
    return torch.stack([row, col], dim=-1).repeat(t, 1), index.repeat(t, 1), weight.repeat(t, 1)


def _layer(blk: nn.Module, h: torch.Tensor, cu: torch.Tensor, longest: int,
           rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """transformers' `Qwen3OmniMoeVisionBlock` with the packed attention."""
    attn, n = blk.attn, h.shape[0]
    q, k, v = attn.qkv(blk.norm1(h)).reshape(n, 3, attn.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
    q, k = apply_rotary_pos_emb_vision(q, k, *rope)
    q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    out = packed_attention(attn, q, k, v, cu, longest, attn.scaling)
    h = h + attn.proj(out.reshape(n, -1).contiguous())
    return h + blk.mlp(blk.norm2(h))


def vision_layout(visual: nn.Module, grids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                       list[int]]:
    """Host tensors of images / videos with `grids` (t, h, w): patch positions `[rows, 2]`, resampling indices
    and weights into the learned position table `[rows, 4]`, and each frame's rows."""
    side, merge = int(visual.config.num_position_embeddings**0.5), visual.config.spatial_merge_size
    pos, index, weight = (torch.cat(x) for x in zip(*(_grid_layout(*g, merge, side) for g in grids)))
    return pos, index, weight, [h * w for t, h, w in grids for _ in range(t)]


def vision_blocks(visual: nn.Module, pixels: torch.Tensor, pos: torch.Tensor, index: torch.Tensor,
                  weight: torch.Tensor, cu: torch.Tensor, longest: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Patches `[rows, C*T*P*P]` with `vision_layout`'s tensors (on their device) and the frames' boundaries
    `cu` (int32) -> merged rows and one DeepStack tensor per level. No host sync."""
    device = pixels.device
    h = visual.patch_embed(pixels)
    h = h + (visual.pos_embed(index) * weight[:, :, None]).sum(1).to(h.dtype)
    freqs = pos[..., None].float() * visual.rotary_pos_emb.inv_freq.to(device=device, dtype=torch.float)
    freqs = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
    freqs = torch.cat([freqs, freqs], dim=-1)
    rope = (freqs.cos(), freqs.sin())
    levels = list(visual.config.deepstack_visual_indexes)
    deepstack = []
    for i, blk in enumerate(visual.blocks):
        h = _layer(blk, h, cu, longest, rope)
        if i in levels:
            deepstack.append(visual.merger_list[levels.index(i)](h))
    return visual.merger(h), deepstack


def vision_forward(visual: nn.Module, pixels: torch.Tensor, grids: list[list[int]]
                   ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Patches `[sum(t*h*w), C*T*P*P]` of images / videos with `grids` (t, h, w) -> merged rows and one
    DeepStack tensor per level."""
    pos, index, weight, frames = vision_layout(visual, grids)
    device = pixels.device
    pos, index, weight = (x.to(device, non_blocking=True) for x in (pos, index, weight))
    cu = F.pad(torch.tensor(frames, dtype=torch.int32).cumsum(0, dtype=torch.int32), (1, 0))
    cu = cu.to(device, non_blocking=True)
    return vision_blocks(visual, pixels, pos, index, weight, cu, max(frames))
