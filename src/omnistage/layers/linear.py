"""Merged projections: several `nn.Linear` over the same input run as one GEMM (vLLM's `QKVParallelLinear` /
`MergedColumnParallelLinear`, here made after loading so module and parameter names stay the checkpoint's)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


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
