"""RMSNorm (Qwen3 / T5 style: statistics in fp32, weight applied in the input dtype), optionally fused with
rotate-half RoPE (the q/k norms of an attention) or with the residual add before it. `rms_norm` / `rms_norm_qk` /
`add_rms_norm` pick the path: the fused Triton kernels on CUDA (`layers.triton_norm`), plain torch ops elsewhere."""

from __future__ import annotations

import torch
from torch import nn

from omnistage.layers import triton_norm, triton_ops
from omnistage.layers.rotary import apply_rotary_emb


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor | None = None,
             sin: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm over the last dim; with `cos/sin [T, D/2]` (x `[T, heads, D]`) RoPE applied after it."""
    if _fused(x, weight):
        return triton_norm.rms_norm(x, weight, eps, cos, sin)
    y = rms_norm_reference(x, weight, eps)
    return y if cos is None else apply_rotary_emb(y, cos, sin)


def rms_norm_qk(qk: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, num_q_heads: int,
                eps: float, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The q and k heads of `qk [T, Hq + Hk, D]` (rows may be strided: a slice of a fused qkv output), each
    RMSNormed with its own weight, then RoPE -> (q [T, Hq, D], k [T, Hk, D]); one kernel on the fast path."""
    if _fused(qk, q_weight) and k_weight.dtype == qk.dtype:
        return triton_norm.rms_norm_qk(qk, q_weight, k_weight, num_q_heads, eps, cos, sin)
    return (rms_norm(qk[:, :num_q_heads], q_weight, eps, cos, sin),
            rms_norm(qk[:, num_q_heads:], k_weight, eps, cos, sin))


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """A residual add and the RMSNorm after it -> (RMSNorm(residual + x), residual + x); `residual` None: there is
    no add, `x` is the stream -> (RMSNorm(x), x). One kernel on the fast path."""
    if residual is None:
        return rms_norm(x, weight, eps), x
    if triton_ops.fast_path(x) and weight.dtype == residual.dtype == x.dtype:
        return triton_norm.add_rms_norm(x, residual, weight, eps)
    h = residual + x
    return rms_norm_reference(h, weight, eps), h


def _fused(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return triton_ops.fast_path(x) and x.shape[-1] % 2 == 0 and weight.dtype == x.dtype


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None
                ) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, cos, sin)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"
