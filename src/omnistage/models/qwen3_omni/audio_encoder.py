"""The audio tower's forward ("AuT": 100-frame chunks through three stride-2 convs, then attention layers over
windows of `n_window_infer` frames) over transformers' `Qwen3OmniMoeAudioEncoder` modules and weights, with the
chunk, window and row indices computed on the host from the clips' lengths: no host sync inside.

transformers' own forward (the reference, `tests/test_encoder_attention.py`: equal on the CPU) derives them from
device tensors, a sync each (about 250 for a 5 s clip, more per clip of a batch).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from omnistage.layers import triton_ops
from omnistage.models.qwen3_omni.encoder_attention import packed_attention
from omnistage.models.qwen3_omni.rope_index import audio_token_count


def audio_layout(lens: list[int], n_window: int, n_window_infer: int,
                 width: int | None = None) -> tuple[list[int], list[int], list[int]]:
    """Chunk lengths (frames), the flat indices of the chunks' valid rows after the convs, and the attention
    windows' lengths (rows), for clips of `lens` frames; `width`: each chunk's rows after the convs (default
    the longest chunk's, as transformers pads them; a full chunk's, as `AudioGraphRunner` does, gives the same
    windows, since only a clip of one chunk can have no full chunk and it is one window either way)."""
    chunk = n_window * 2
    chunks = [c for n in lens for c in [chunk] * (n // chunk) + ([n % chunk] if n % chunk else [])]
    after = np.array([audio_token_count(c, n_window) for c in chunks], dtype=np.int64)
    width = int(after.max()) if width is None else width
    valid = np.flatnonzero(np.arange(width)[None] < after[:, None]).tolist()
    window = width * (n_window_infer // chunk)
    windows = []
    for n in lens:
        rows = audio_token_count(n, n_window)
        windows += [window] * (rows // window) + ([rows % window] if rows % window else [])
    return chunks, valid, windows


def _layer(layer: nn.Module, h: torch.Tensor, cu: torch.Tensor, longest: int) -> torch.Tensor:
    """transformers' `Qwen3OmniMoeAudioEncoderLayer` (pre-norm attention and MLP) with the packed attention."""
    attn, n = layer.self_attn, h.shape[0]
    x = layer.self_attn_layer_norm(h)
    q, k, v = (proj(x).reshape(n, attn.num_heads, -1).transpose(0, 1).unsqueeze(0)
               for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
    out = packed_attention(attn, q, k, v, cu, longest, attn.scaling)
    h = h + attn.out_proj(out.reshape(n, -1).contiguous())
    h = h + layer.fc2(layer.activation_fn(layer.fc1(layer.final_layer_norm(h))))
    if h.dtype == torch.float16:
        clamp = torch.finfo(h.dtype).max - 1000
        h = torch.clamp(h, min=-clamp, max=clamp)
    return h


def conv_rows(tower: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Padded chunks `[C, 1, mels, frames]` -> their rows after the convs, positions added `[C, t, d_model]`."""
    parts = []
    for part in x.split(tower.conv_chunksize, dim=0):
        for conv in (tower.conv2d1, tower.conv2d2, tower.conv2d3):
            part = F.gelu(conv(part))
        parts.append(part)
    x = torch.cat(parts, dim=0)
    b, c, f, t = x.size()
    x = tower.conv_out(x.permute(0, 3, 1, 2).contiguous().view(b, t, c * f))
    return x + tower.positional_embedding.positional_embedding[:t].unsqueeze(0).to(x.dtype)


def encode_rows(tower: nn.Module, h: torch.Tensor, cu: torch.Tensor, longest: int) -> torch.Tensor:
    """The attention layers over rows `h` in windows `cu` (int32 offsets, on h's device), then the projection."""
    for layer in tower.layers:
        h = _layer(layer, h, cu, longest)
    return tower.proj2(tower.act(tower.proj1(tower.ln_post(h))))


def audio_forward(tower: nn.Module, features: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """Clips' log-mel frames `[mels, sum(lens)]` (concatenated) -> audio token rows `[N, output_dim]`."""
    chunks, valid, windows = audio_layout(lens, tower.n_window, tower.n_window_infer)
    padded = nn.utils.rnn.pad_sequence(features.T.split(chunks), batch_first=True).transpose(1, 2)
    x = padded.unsqueeze(1).to(tower.conv2d1.weight.dtype)
    live = x.shape[0]
    if triton_ops.fast_path(x):  # NOTE: a new chunk count cost ~15 ms on its first call (H200): 2^k chunks
        x = F.pad(x, (0, 0, 0, 0, 0, 0, 0, (1 << (live - 1).bit_length()) - live))
    x = conv_rows(tower, x)[:live]
    index = torch.tensor(valid).to(x.device, non_blocking=True)
    h = torch.index_select(x.reshape(-1, x.shape[-1]), 0, index)
    cu = F.pad(torch.tensor(windows, dtype=torch.int32).cumsum(0, dtype=torch.int32), (1, 0))
    return encode_rows(tower, h, cu.to(x.device, non_blocking=True), max(windows))
