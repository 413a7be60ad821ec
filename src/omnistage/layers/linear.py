"""Linear layers' GEMMs: `linear` is the ONE path choice (the skinny Triton GEMM of `layers.triton_linear` for
decode row counts on the fast path, `F.linear` otherwise); merged projections: several `nn.Linear` over the same
input run as one GEMM (vLLM's `QKVParallelLinear` / `MergedColumnParallelLinear`, here made after loading so
module and parameter names stay the checkpoint's)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from omnistage.layers import triton_linear


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`; `x [..., K]` with few rows through `triton_linear` where it `supports` them
    (leading dims flattened when `x` is contiguous)."""
    flat = x.view(-1, x.shape[-1]) if x.dim() > 2 and x.is_contiguous() else x
    if triton_linear.supports(flat, weight):
        return triton_linear.linear(flat, weight, bias).view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


@torch.no_grad()
def merge_linears(linears: Sequence[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight `[sum(out_features), in_features]` (and bias) holding the linears' weights in order; each
    linear's weight (bias) becomes a view into it, so memory holds one copy and loading into the linears
    (`load_state_dict`, `copy_`) updates the merged weight.
    NOTE: move the module before merging: `.to()` afterwards gives the linears new tensors, not views."""
    weight = torch.cat([lin.weight for lin in linears])
    bias = None if linears[0].bias is None else torch.cat([lin.bias for lin in linears])
    start = 0
    for lin in linears:
        end = start + lin.out_features
        lin.weight.data = weight[start:end]
        if bias is not None:
            lin.bias.data = bias[start:end]
        start = end
    return weight, bias
