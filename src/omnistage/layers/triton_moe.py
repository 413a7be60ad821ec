"""MoE bookkeeping kernels (Triton) for the CUDA fast path (`layers.moe` picks them).

Around the two grouped GEMMs the eager block ran ~22 small kernels (softmax, topk, renormalise, cast, a radix
argsort, counts, cumsum, gathers, the weighted un-permute); these three kernels replace them:
- `route(logits, top_k, renormalize)`: softmax in fp32, top-k, optional renormalisation and the cast, one
  program per token; ids and order as `torch.topk` (descending; equal probabilities: the lower expert first).
- `moe_align(ids, num_experts)`: the flat slots counting-sorted by expert (stable, as `argsort(stable=True)`),
  one program per expert; `token` (source token of each sorted row), `pos` (sorted row of each slot), `offs`.
- `moe_unpermute(y, weights, pos, shared)`: `out[t] = sum_j round(y[pos[t, j]] * w[t, j])`, products rounded to
  the dtype as eager bf16 rounds them, summed in fp32 over j = 0..k-1 and rounded once; then the talker's shared
  expert, `+ sigmoid(gate) * shared` (three eager kernels a layer less).
All shapes follow the inputs' shapes (no host syncs): CUDA-graph capturable.
NOTE: Triton flushes fp32 denormals, so probabilities below ~1e-38 are 0 here (torch keeps them): only a row
whose k-th probability is that small (logit gaps over ~87) can pick other experts than torch, with weight 0.
"""

from __future__ import annotations

import torch

from omnistage.layers import triton_ops, triton_pdl

# NOTE: every expert's program reads all T*k ids twice, so above this many slots (a long prefill) the torch
# sort is used (`layers.moe`): unmeasured on the GPU, a guess.
MAX_ALIGN_SLOTS = 8192

if triton_ops.triton is not None:
    from omnistage.layers.triton_ops import libdevice, tl, triton
    from omnistage.layers.triton_pdl import gdc

    @triton.jit
    def _route_kernel(logits_ptr, stride, w_ptr, ids_ptr, num_experts, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                      RENORM: tl.constexpr, E_PAD: tl.constexpr, PDL: tl.constexpr):
        gdc(PDL)
        t = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, E_PAD)
        x = tl.load(logits_ptr + t * stride + cols, mask=cols < num_experts, other=-float("inf"))
        x = x.to(tl.float32)
        e = libdevice.exp(x - tl.max(x, 0))
        p = libdevice.div_rn(e, tl.sum(e, 0))  # NOTE: padding lanes are 0: after every real expert on ties
        slots = tl.arange(0, K_PAD)
        vals = tl.zeros([K_PAD], tl.float32)
        idx = tl.zeros([K_PAD], tl.int32)
        for j in tl.static_range(TOP_K):
            v, i = tl.max(p, 0, return_indices=True, return_indices_tie_break_left=True)
            vals = tl.where(slots == j, v, vals)
            idx = tl.where(slots == j, i, idx)
            p = tl.where(cols == i, -1.0, p)
        if RENORM:
            vals = libdevice.div_rn(vals, tl.sum(vals, 0))
        out = t * TOP_K + slots
        tl.store(w_ptr + out, vals.to(w_ptr.dtype.element_ty), mask=slots < TOP_K)
        tl.store(ids_ptr + out, idx.to(tl.int64), mask=slots < TOP_K)

    @triton.jit
    def _align_kernel(ids_ptr, token_ptr, pos_ptr, offs_ptr, num_slots, TOP_K: tl.constexpr,
                      CHUNKS: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr):
        gdc(PDL)
        e = tl.program_id(0)
        lanes = tl.arange(0, CHUNK)
        below = tl.zeros([], tl.int32)  # slots of experts < e: this expert's first row
        count = tl.zeros([], tl.int32)
        for c in range(CHUNKS):
            m = c * CHUNK + lanes < num_slots
            ex = tl.load(ids_ptr + c * CHUNK + lanes, mask=m, other=-1)
            below += tl.sum((m & (ex < e)).to(tl.int32), 0)
            count += tl.sum((ex == e).to(tl.int32), 0)
        tl.store(offs_ptr + e, below + count)
        for c in range(CHUNKS):
            slot = c * CHUNK + lanes
            hit = tl.load(ids_ptr + slot, mask=slot < num_slots, other=-1) == e
            row = below + tl.cumsum(hit.to(tl.int32), 0) - 1
            tl.store(pos_ptr + slot, row.to(tl.int64), mask=hit)
            tl.store(token_ptr + row, (slot // TOP_K).to(tl.int64), mask=hit)
            below += tl.sum(hit.to(tl.int32), 0)

    @triton.jit
    def _unpermute_kernel(y_ptr, w_ptr, pos_ptr, g_ptr, g_stride, s_ptr, out_ptr, hidden, TOP_K: tl.constexpr,
                          SHARED: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        gdc(PDL)
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = cols < hidden
        dt = out_ptr.dtype.element_ty
        acc = tl.zeros([BLOCK], tl.float32)
        for j in tl.static_range(TOP_K):
            row = tl.load(pos_ptr + t * TOP_K + j)
            w = tl.load(w_ptr + t * TOP_K + j).to(tl.float32)
            y = tl.load(y_ptr + row * hidden + cols, mask=m, other=0.0).to(tl.float32)
            acc += (y * w).to(dt).to(tl.float32)
        out = acc.to(dt)
        # NOTE: launched without fp fusion: LLVM would turn the rounded product and sum below into one bf16 fma
        if SHARED:  # + sigmoid(gate) * shared, each op rounded to the dtype as the eager chain rounds it
            g = tl.load(g_ptr + t * g_stride).to(tl.float32)
            gate = libdevice.div_rn(1.0, 1.0 + libdevice.exp(-g)).to(dt).to(tl.float32)
            s = tl.load(s_ptr + t * hidden + cols, mask=m, other=0.0).to(tl.float32)
            out = (out.to(tl.float32) + (gate * s).to(dt).to(tl.float32)).to(dt)
        tl.store(out_ptr + t * hidden + cols, out, mask=m)


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] in the logits dtype, expert ids [T, k] int64) of `router_logits [T, E]` (rows may be
    strided)."""
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    t, e = logits.shape
    weights = torch.empty(t, top_k, dtype=logits.dtype, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.long, device=logits.device)
    _route_kernel[(t,)](logits, logits.stride(0), weights, ids, e, TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k),
                        RENORM=renormalize, E_PAD=triton.next_power_of_2(e), num_warps=1, **triton_pdl.launch(logits))
    return weights, ids


def moe_align(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flat slots of `ids [T, k]` sorted by expert (stable): (token [T*k] int64: source token of each sorted row,
    pos [T*k] int64: sorted row of each slot, offs [E] int32: cumulative rows per expert)."""
    ids = ids.contiguous()
    n = ids.numel()
    token = torch.empty(n, dtype=torch.long, device=ids.device)
    pos = torch.empty(n, dtype=torch.long, device=ids.device)
    offs = torch.empty(num_experts, dtype=torch.int32, device=ids.device)
    chunk = min(1024, triton.next_power_of_2(max(n, 16)))
    _align_kernel[(num_experts,)](ids, token, pos, offs, n, TOP_K=ids.shape[1], CHUNKS=triton.cdiv(n, chunk),
                                  CHUNK=chunk, num_warps=max(1, min(4, chunk // 256)), **triton_pdl.launch(ids))
    return token, pos, offs


def moe_unpermute(y: torch.Tensor, weights: torch.Tensor, pos: torch.Tensor,
                  shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """`out [T, H]`: each token's k expert rows `y[pos]` scaled by `weights [T, k]` and summed; with `shared`
    (gate logits [T, 1], rows may be strided; shared expert output [T, H]) plus `sigmoid(gate) * shared`."""
    y = y.contiguous()
    gate, s = shared if shared is not None else (y, y)
    t, k = weights.shape
    h = y.shape[1]
    out = torch.empty(t, h, dtype=y.dtype, device=y.device)
    block = min(1024, triton.next_power_of_2(h))
    _unpermute_kernel[(t, triton.cdiv(h, block))](y, weights.contiguous(), pos, gate, gate.stride(0), s.contiguous(),
                                                   out, h, TOP_K=k, SHARED=shared is not None, BLOCK=block,
                                                   enable_fp_fusion=False, **triton_pdl.launch(y))
    return out
