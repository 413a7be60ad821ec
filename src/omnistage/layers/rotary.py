"""Rotary position embedding: plain 1-D RoPE and Qwen3-Omni's interleaved M-RoPE.

Positions are flat: `[T]` (text / audio, or any 1-D RoPE model) or `[3, T]` (temporal, height, width).
With interleaved M-RoPE, frequency slot j takes its position from axis H when `j % 3 == 1` and
`j < 3 * mrope_section[1]`, from axis W when `j % 3 == 2` and `j < 3 * mrope_section[2]`, and from
axis T otherwise. With identical T/H/W components this is exactly 1-D RoPE.
"""

from __future__ import annotations

import torch
from torch import nn


def mrope_axis_map(mrope_section: list[int], half: int) -> torch.Tensor:
    """For each of the `half` frequency slots, the position axis (0=T, 1=H, 2=W) it reads."""
    if sum(mrope_section) != half:
        raise ValueError(f"sum(mrope_section)={sum(mrope_section)} must equal head_dim // 2 = {half}")
    axis = torch.zeros(half, dtype=torch.long)
    for dim, offset in ((1, 1), (2, 2)):
        axis[offset:3 * mrope_section[dim]:3] = dim
    return axis


class RotaryEmbedding(nn.Module):
    """cos/sin tables `[T, head_dim // 2]` for flat positions, computed in fp32 like transformers."""

    def __init__(self, head_dim: int, base: float, mrope_section: list[int] | None = None) -> None:
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        axis = None if mrope_section is None else mrope_axis_map(list(mrope_section), head_dim // 2)
        self.register_buffer("mrope_axis", axis, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 2:
            if self.mrope_axis is None:
                raise ValueError("3-D positions given to a 1-D RoPE")
            # [half, T] -> [T, half]: each slot reads its own axis
            pos = positions.index_select(0, self.mrope_axis).t()
        else:
            pos = positions[:, None]
        freqs = (pos.float() * self.inv_freq).contiguous()
        return freqs.cos().to(dtype), freqs.sin().to(dtype)


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on `x [T, heads, head_dim]` with `cos/sin [T, head_dim // 2]`."""
    c, s = cos[:, None, :], sin[:, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
