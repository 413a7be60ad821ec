"""Mixture of experts (Qwen3-MoE): softmax router, top-k, SwiGLU experts held fused per layer.

Expert weights: `gate_up_proj [E, 2I, H]` (gate rows first, then up) and `down_proj [E, H, I]`,
the in-memory layout of transformers. `fused_experts` is the ONE place that picks the path:
- reference: loop over the experts that were hit (plain torch, CPU / tests; host syncs);
- grouped: tokens sorted by expert, two `torch._grouped_mm` calls (CUDA bf16). Per-expert row
  counts come from `scatter_add_` rather than `bincount` / `histc`, so there is no host sync and the
  path is CUDA-graph capturable; the top-k outputs are gathered back and summed in a fixed order
  (deterministic, no atomics). With `fast_path` the routing and this bookkeeping run as Triton
  kernels (`layers.triton_moe`), the torch sort staying for long prefills;
- fused (fast path, decode sizes; FP8 experts at every size): both expert GEMMs and the activation in Triton
  (`layers.triton_fused_moe`).
FP8 experts (`scales`: fp32 per expert per output row, `layers.fp8`): the fused kernel loads E4M3 tiles (weight-only);
off the fast path the grouped path quantises its rows per token and runs `torch._scaled_grouped_mm`, or past
`DEQUANTIZE_SLOTS` (and where torch lacks it) dequantises the experts for the bf16 grouped GEMMs; the reference
loop dequantises each hit expert.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from omnistage.layers import fp8, triton_fused_moe, triton_moe
from omnistage.layers.linear import merge_linears
from omnistage.layers.mlp import SwiGLUMLP, silu_mul
from omnistage.layers.triton_ops import fast_path

Shared = tuple[torch.Tensor, torch.Tensor]  # the talker's shared expert: (gate logits [T, 1], its output [T, H])
Scales = tuple[torch.Tensor, torch.Tensor]  # FP8 experts' row scales: (gate_up [E, 2I], down [E, H])
# NOTE: off the fast path, past this many slots (T*k) FP8 experts are dequantised for the bf16 grouped GEMMs: on
# the H200 (`a7f39f0`) `_scaled_grouped_mm` took 2.64 ms a thinker layer at 4 096 tokens, against 1.42 dequantised
# in one Triton pass (since removed: the fast path runs FP8 experts in `triton_fused_moe`)
DEQUANTIZE_SLOTS = 16384


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] in the logits dtype, expert ids [T, k]); softmax in fp32."""
    if fast_path(router_logits):
        return triton_moe.route(router_logits, top_k, renormalize)
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


def fused_experts_reference(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                            weights: torch.Tensor, ids: torch.Tensor, scales: Scales | None = None) -> torch.Tensor:
    out = torch.zeros_like(x)
    for e in ids.unique().tolist():
        token, slot = torch.where(ids == e)
        w13, w2 = w_gate_up[e], w_down[e]
        if scales is not None:
            w13, w2 = fp8.dequantize(w13, scales[0][e], x.dtype), fp8.dequantize(w2, scales[1][e], x.dtype)
        gate, up = F.linear(x[token], w13).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2) * weights[token, slot, None]
        out.index_add_(0, token, y)
    return out


def sort_by_expert(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flat slots sorted by expert (stable): (source token of each sorted row, sorted row of each slot,
    cumulative rows per expert int32); `triton_moe.moe_align` in torch ops."""
    flat = ids.flatten()
    order = flat.argsort(stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    pos = torch.empty_like(order).index_copy_(0, order, torch.arange(order.numel(), device=ids.device))
    return order // ids.shape[1], pos, counts.cumsum(0, dtype=torch.int32)


def unpermute(y: torch.Tensor, weights: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    return (y[pos].view(*weights.shape, -1) * weights[..., None]).sum(dim=1)


def add_shared(out: torch.Tensor, shared: Shared | None) -> torch.Tensor:
    """`out + sigmoid(gate) * shared_out` (the eager chain that `triton_moe.moe_unpermute` fuses)."""
    return out if shared is None else out + torch.sigmoid(shared[0]) * shared[1]


def grouped_mm(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Rows of `a` sorted by expert times `w [E, N, K]`'s experts transposed; FP8 `w` (`scale [E, N]`): `a`
    quantised per row, `torch._scaled_grouped_mm`, out in a's dtype."""
    if scale is None:
        return torch._grouped_mm(a, w.transpose(1, 2), offs=offs)
    aq, a_scale = fp8.quantize_rows(a)
    return torch._scaled_grouped_mm(aq, w.transpose(1, 2), a_scale, scale, offs=offs, out_dtype=a.dtype)


def fused_experts_grouped(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, weights: torch.Tensor,
                          ids: torch.Tensor, fused_ops: bool = False, shared: Shared | None = None,
                          scales: Scales | None = None) -> torch.Tensor:
    kernel_sort = fused_ops and ids.numel() <= triton_moe.MAX_ALIGN_SLOTS
    token, pos, offs = (triton_moe.moe_align if kernel_sort else sort_by_expert)(ids, w_gate_up.shape[0])
    s13, s2 = (None, None) if scales is None else scales
    gate_up = grouped_mm(x[token], w_gate_up, offs, s13)
    y = grouped_mm(silu_mul(gate_up), w_down, offs, s2)
    if fused_ops:
        return triton_moe.moe_unpermute(y, weights, pos, shared)
    return add_shared(unpermute(y, weights, pos), shared)


def fused_experts(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor, shared: Shared | None = None, scales: Scales | None = None) -> torch.Tensor:
    """Path choice: on the fast path the fused Triton experts up to `triton_fused_moe.MAX_SLOTS` bf16 slots
    (decode), FP8 experts at every size; grouped GEMM on CUDA bf16 (rows must be 16-byte aligned, FP8 ones 16
    elements; with `fast_path` its bookkeeping in Triton kernels); the reference loop otherwise. `shared` is added
    as `add_shared` adds it (in the un-permute kernel on the fast path); `scales`: the experts are FP8 (see the
    module docstring)."""
    fused = scales is not None or ids.numel() <= triton_fused_moe.MAX_SLOTS
    if fast_path(x) and x.dtype == torch.bfloat16 and fused:
        return triton_fused_moe.fused_moe(x, w_gate_up, w_down, weights, ids, shared, scales)
    row = 16 if scales is not None else 16 // x.element_size()
    aligned = all(n % row == 0 for n in (x.shape[-1], w_down.shape[-1]))
    if x.is_cuda and x.dtype == torch.bfloat16 and aligned and hasattr(torch, "_grouped_mm"):
        long_prefill = ids.numel() > DEQUANTIZE_SLOTS
        if scales is not None and (long_prefill or not hasattr(torch, "_scaled_grouped_mm")):
            w_gate_up, w_down = (fp8.dequantize(w, s, x.dtype) for w, s in zip((w_gate_up, w_down), scales))
            scales = None
        return fused_experts_grouped(x, w_gate_up, w_down, weights, ids, fast_path(x), shared, scales)
    return add_shared(fused_experts_reference(x, w_gate_up, w_down, weights, ids, scales), shared)


_EXPERTS_ON_META = contextvars.ContextVar("experts_on_meta", default=False)


@contextlib.contextmanager
def experts_on_meta() -> Iterator[None]:
    """`FusedExperts` made within it hold meta tensors until `empty_fp8` gives them E4M3 storage:
    `quantization: fp8` fills them as the stage loads, so its experts are never held in the stage's dtype."""
    token = _EXPERTS_ON_META.set(True)
    try:
        yield
    finally:
        _EXPERTS_ON_META.reset(token)


class FusedExperts(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        on = {"device": "meta"} if _EXPERTS_ON_META.get() else {}
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size, **on))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size, **on))
        self.register_buffer("gate_up_scale", None)
        self.register_buffer("down_scale", None)

    def empty_fp8(self, device: torch.device) -> None:
        """Both expert weights as empty E4M3 with fp32 scales per expert per output row, on `device`."""
        for name in ("gate_up_proj", "down_proj"):
            shape = getattr(self, name).shape
            q = torch.empty(shape, dtype=fp8.FP8, device=device)
            setattr(self, name, nn.Parameter(q, requires_grad=False))
            scale = torch.empty(shape[:2], dtype=torch.float32, device=device)
            setattr(self, name.replace("_proj", "_scale"), scale)

    @torch.no_grad()
    def fill_fp8(self, name: str, values: torch.Tensor) -> None:
        """`name` ("gate_up_proj" / "down_proj", FP8) and its scales set to `values` quantised per row."""
        q, scale = getattr(self, name), getattr(self, name.replace("_proj", "_scale"))
        for e in range(0, q.shape[0], 16):  # NOTE: 16 experts at a time: fp32 temporaries of 16, not of all
            q[e:e + 16], scale[e:e + 16] = fp8.quantize_rows(values[e:e + 16])

    @torch.no_grad()
    def quantize_fp8(self) -> None:
        """Both expert weights in E4M3 with fp32 scales per expert per output row (`layers.fp8`); a no-op when
        they were made in FP8 (`empty_fp8`)."""
        if self.gate_up_proj.dtype == fp8.FP8:
            return
        weights = {name: getattr(self, name) for name in ("gate_up_proj", "down_proj")}
        self.empty_fp8(self.gate_up_proj.device)
        for name, w in weights.items():
            self.fill_fp8(name, w)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, shared: Shared | None = None
                ) -> torch.Tensor:
        scales = None if self.gate_up_scale is None else (self.gate_up_scale, self.down_scale)
        return fused_experts(x, self.gate_up_proj, self.down_proj, weights, ids, shared, scales)


class SparseMoeBlock(nn.Module):
    """Router `gate` + routed `experts`; with `shared_intermediate_size > 0` also a shared SwiGLU
    expert scaled by `sigmoid(shared_expert_gate(x))` (the talker's block)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 norm_topk_prob: bool, shared_intermediate_size: int = 0) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = FusedExperts(num_experts, hidden_size, intermediate_size)
        shared = shared_intermediate_size > 0
        self.shared_expert = SwiGLUMLP(hidden_size, shared_intermediate_size) if shared else None
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False) if shared else None
        self.router_weight: torch.Tensor | None = None

    def fuse_projections(self) -> None:
        """The router and the shared expert's gate as one GEMM (their weights become views into
        `router_weight` [E + 1, H])."""
        if self.shared_expert is not None:
            self.router_weight, _ = merge_linears([self.gate, self.shared_expert_gate])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x) if self.router_weight is None else F.linear(x, self.router_weight)
        e = self.gate.out_features
        weights, ids = select_experts(logits[:, :e], self.top_k, self.norm_topk_prob)
        shared = None
        if self.shared_expert is not None:
            gate = self.shared_expert_gate(x) if self.router_weight is None else logits[:, e:]
            shared = (gate, self.shared_expert(x))
        return self.experts(x, weights, ids, shared)
