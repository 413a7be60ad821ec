"""Linear layers' GEMMs: `linear` is the ONE path choice (the skinny Triton GEMM of `layers.triton_linear` for
decode row counts on the fast path, `F.linear` otherwise; FP8 weights (`layers.fp8`): the skinny GEMM loading them,
`torch._scaled_mm` on CUDA, else dequantised per call); merged projections: several `nn.Linear` over the same
input run as one GEMM (vLLM's `QKVParallelLinear` / `MergedColumnParallelLinear`, here made after loading so
module and parameter names stay the checkpoint's); `quantize_linears`: linears (merged or not) in FP8."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from omnistage.layers import fp8, triton_linear


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           scale: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, or with `scale` of an FP8 `weight` `F.linear(x, weight x scale, bias)`; `x [..., K]`
    with few rows through `triton_linear` where it `supports` them (leading dims flattened when `x` is
    contiguous)."""
    flat = x.view(-1, x.shape[-1]) if x.dim() > 2 and x.is_contiguous() else x
    if triton_linear.supports(flat, weight, scale=scale):
        return triton_linear.linear(flat, weight, bias, scale).view(*x.shape[:-1], weight.shape[0])
    if scale is None:
        return F.linear(x, weight, bias)
    if fp8.scaled_mm_supports(flat, weight):
        return fp8.scaled_mm(flat, weight, scale, bias).view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, fp8.dequantize(weight, scale, x.dtype), bias)


class Fp8Linear(nn.Module):
    """An `nn.Linear` held in FP8: `weight [out, in]` E4M3 with fp32 `weight_scale [out]` (`layers.fp8`)."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.register_buffer("weight_scale", scale)
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.weight_scale)


def project(x: torch.Tensor, lin: nn.Linear | Fp8Linear) -> torch.Tensor:
    """`lin(x)` through `linear` (the skinny GEMMs; FP8 weights with their scales)."""
    return linear(x, lin.weight, lin.bias, lin.weight_scale if isinstance(lin, Fp8Linear) else None)


@torch.no_grad()
def quantize_linears(module: nn.Module, names: Sequence[str], merged: torch.Tensor | None
                     ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The `nn.Linear`s `module.<names>` replaced by `Fp8Linear`s. `merged`: their merged weight
    (`merge_linears`), quantised per row as one tensor, the linears' weights and scales views into it and its
    scales (returned: the merged FP8 weight and scales; without `merged` (None, None))."""
    linears = [getattr(module, n) for n in names]
    q, scale = fp8.quantize_rows(merged) if merged is not None else (None, None)
    start = 0
    for name, lin in zip(names, linears):
        end = start + lin.out_features
        rows = fp8.quantize_rows(lin.weight) if q is None else (q[start:end], scale[start:end])
        setattr(module, name, Fp8Linear(*rows, lin.bias))
        start = end
    return q, scale


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
