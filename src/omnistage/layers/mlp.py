"""Dense SwiGLU MLP (Qwen3 `gate_proj` / `up_proj` / `down_proj`); `fuse_projections` merges gate and up
into one GEMM whose output `silu_mul` turns into the activation in one kernel (CUDA fast path); at decode row
counts the GEMM and the activation are one kernel (`gate_up_silu_mul`); `quantize_fp8` holds the projections in FP8
(the merged gate/up weight quantised per row)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from omnistage.layers import triton_activation, triton_linear, triton_ops
from omnistage.layers.linear import linear, merge_linears, project, quantize_linears


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` of `gate_up [..., 2I]` (gate first): one kernel on the fast path, eager elsewhere."""
    if triton_ops.fast_path(gate_up):
        return triton_activation.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gate_up_silu_mul(x: torch.Tensor, gate_up_weight: torch.Tensor, scale: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """`silu_mul(linear(x, gate_up_weight, scale=scale))`: one skinny Triton GEMM where `triton_linear` supports
    it."""
    if triton_linear.supports(x, gate_up_weight, gated=True, scale=scale):
        return triton_linear.linear_silu_mul(x, gate_up_weight, scale)
    return silu_mul(F.linear(x, gate_up_weight) if scale is None else linear(x, gate_up_weight, scale=scale))


class SwiGLUMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.gate_up_weight: torch.Tensor | None = None
        self.gate_up_scale: torch.Tensor | None = None

    def fuse_projections(self) -> None:
        """gate_proj and up_proj as one GEMM (their weights become views into `gate_up_weight`)."""
        self.gate_up_weight, _ = merge_linears([self.gate_proj, self.up_proj])

    def quantize_fp8(self) -> None:
        """The three projections in FP8 (`layers.linear.Fp8Linear`; once fused, `gate_up_weight` too)."""
        self.gate_up_weight, self.gate_up_scale = quantize_linears(self, ["gate_proj", "up_proj"],
                                                                   self.gate_up_weight)
        quantize_linears(self, ["down_proj"], None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_weight is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return project(gate_up_silu_mul(x, self.gate_up_weight, self.gate_up_scale), self.down_proj)
