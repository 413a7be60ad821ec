"""Decode attention (Triton) that also writes the new K/V into the cache: one launch per layer instead of
store_kvcache's copies + gathers + mask + SDPA (`layers.attention` / the code predictor pick it through
`triton_ops.fast_path`).

One program per (row, kv head) serves the GROUP = H / KV query heads of that kv head (and the row's n new
positions): it stores the row's new k/v, attends to them from registers (causally among themselves), then
streams the row's cached positions in tiles of BLOCK_N with an online softmax in fp32. The cached positions
are read through a block table, so the cost follows each row's real context length, not the table's width.
- `decode_attention_with_kvcache`: paged cache `[num_blocks, block_size, KV, D]`, one new token per row at
  `slot_mapping[row]`, `context_lens[row]` tokens incl. the new one; a row of length 0 writes nothing.
- `static_attention_with_kvcache`: the code predictor's per-row cache `[rows, G, KV, D]` (a paged cache of one
  block of G positions per row), n new positions from `pos`, `pos` cached ones before them.
"""

from __future__ import annotations

import os

import torch

from omnistage.layers import triton_ops, triton_pdl

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

if triton_ops.triton is not None:
    from omnistage.layers.triton_ops import tl, triton
    from omnistage.layers.triton_pdl import gdc

    @triton.jit
    def _online_softmax(m_i, l_i, s):
        """Fold scores `s [M, N]` (log2 units) into the running max/sum: (max, sum, rescale of acc, p)."""
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        return m_new, l_i * alpha + tl.sum(p, 1), alpha[:, None], p

    @triton.jit(do_not_specialize=["static_past"])
    def _attention_with_kvcache_kernel(
            q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, out_ptr, slots_ptr, tables_ptr, lens_ptr,
            q_s0, q_s1, k_s0, k_s1, v_s0, v_s1, table_stride, static_past, qk_scale,
            KV: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr, N_NEW: tl.constexpr,
            PAGED: tl.constexpr, PRECISION: tl.constexpr, INTERPRET_BOUND: tl.constexpr, BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
        gdc(PDL)
        row, kvh = tl.program_id(0), tl.program_id(1)
        d = tl.arange(0, BLOCK_D)
        dm = d < D
        rows_m = tl.arange(0, BLOCK_M)  # query row m: new position m // GROUP, head kvh * GROUP + m % GROUP
        mm = rows_m < N_NEW * GROUP
        new_i = rows_m // GROUP
        heads_m = kvh * GROUP + rows_m % GROUP
        tok_m = row * N_NEW + new_i
        if PAGED:  # per-row length, slot and table
            past = tl.load(lens_ptr + row) - 1
            slot = tl.load(slots_ptr + row).to(tl.int64)
        else:  # static: the row's block is `row`, `static_past` positions cached
            past = row * 0 + static_past
            slot = row.to(tl.int64) * BLOCK_SIZE + static_past
        # NOTE: a block mask (not a scalar bool) for Triton 3.9's interpreter; a length-0 row's slot may be garbage
        live = dm & ((d * 0 + past) >= 0)
        q = tl.load(q_ptr + tok_m[:, None].to(tl.int64) * q_s0 + heads_m[:, None] * q_s1 + d[None, :],
                    mask=mm[:, None] & dm[None, :], other=0.0)
        m_i = tl.full([BLOCK_M], -float("inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for j in tl.static_range(N_NEW):
            # NOTE: the new tokens come from registers, never read back from the cache: no ordering between the
            # store and loads of other threads is needed, and padding rows sharing one scratch slot stay finite.
            tok = (row * N_NEW + j).to(tl.int64)
            kj = tl.load(k_ptr + tok * k_s0 + kvh * k_s1 + d, mask=dm, other=0.0)
            vj = tl.load(v_ptr + tok * v_s0 + kvh * v_s1 + d, mask=dm, other=0.0)
            dst = (slot + j) * (KV * D) + kvh * D + d
            tl.store(k_cache_ptr + dst, kj, mask=live)
            tl.store(v_cache_ptr + dst, vj, mask=live)
            sj = tl.sum(q.to(tl.float32) * kj.to(tl.float32)[None, :], 1) * qk_scale
            m_i, l_i, aj, pj = _online_softmax(m_i, l_i, tl.where(new_i >= j, sj, -float("inf"))[:, None])
            acc = acc * aj + pj * vj.to(tl.float32)[None, :]
        # NOTE: on the GPU the loop runs to the row's own length (a runtime bound: a software-pipelined scf.for,
        # no tiles past the length; a `while` would not be pipelined). 3.6's interpreter takes no loaded value in
        # `range()` (nor a constexpr assigned to a name: it becomes a tensor there): there INTERPRET_BOUND (the
        # cache's reach) bounds it, tiles past the length fully masked. A constexpr 0 bound crashes 3.6's compiler.
        for start in range(0, INTERPRET_BOUND if INTERPRET_BOUND > 0 else past, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            pm = pos < past
            if PAGED:
                blk = tl.load(tables_ptr + row * table_stride + pos // BLOCK_SIZE, mask=pm, other=0)
            else:
                blk = pos * 0 + row
            off = (blk.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE)[:, None] * (KV * D) + kvh * D + d[None, :]
            kt = tl.load(k_cache_ptr + off, mask=pm[:, None] & dm[None, :], other=0.0)
            vt = tl.load(v_cache_ptr + off, mask=pm[:, None] & dm[None, :], other=0.0)
            s = tl.dot(q, tl.trans(kt), input_precision=PRECISION) * qk_scale
            s = tl.where(pm[None, :], s, -float("inf"))
            m_i, l_i, alpha, p = _online_softmax(m_i, l_i, s)
            acc = acc * alpha + tl.dot(p.to(vt.dtype), vt, input_precision=PRECISION)
        out = acc / l_i[:, None]
        dst = (tok_m[:, None].to(tl.int64) * GROUP * KV + heads_m[:, None]) * D + d[None, :]
        tl.store(out_ptr + dst, out.to(out_ptr.dtype.element_ty), mask=mm[:, None] & dm[None, :])


def _launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            scale: float, rows: int, n_new: int, past: int, slots: torch.Tensor | None = None,
            tables: torch.Tensor | None = None, lens: torch.Tensor | None = None) -> torch.Tensor:
    heads, d = q.shape[1], q.shape[2]
    kv = k.shape[1]
    if any(t.stride(2) != 1 for t in (q, k, v)) or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("q/k/v need unit-stride head dims and the caches must be contiguous")
    group = heads // kv
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _attention_with_kvcache_kernel[(rows, kv)](
        q, k, v, k_cache, v_cache, out, slots, tables, lens, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), 0 if tables is None else tables.stride(0), past, scale * 1.4426950408889634,
        KV=kv, GROUP=group, D=d, BLOCK_SIZE=k_cache.shape[1], N_NEW=n_new, PAGED=tables is not None,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        INTERPRET_BOUND=k_cache.shape[1] * (1 if tables is None else tables.shape[1]) if _INTERPRETED else 0,
        BLOCK_M=max(16, triton.next_power_of_2(n_new * group)), BLOCK_N=16 if tables is None else 64,
        BLOCK_D=max(16, triton.next_power_of_2(d)), num_warps=4, **triton_pdl.launch(q))
    return out


def decode_attention_with_kvcache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                                  v_cache: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                                  context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """`store_kvcache` + `paged_decode_attention` in one launch: q `[B, H, D]`, k/v `[B, KV, D]` (one new token
    per row), caches `[num_blocks, block_size, KV, D]`; returns `[B, H, D]`. No host sync."""
    return _launch(q, k, v, k_cache, v_cache, scale, q.shape[0], 1, 0, slot_mapping, block_tables, context_lens)


def static_attention_with_kvcache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                                  v_cache: torch.Tensor, pos: int, rows: int, scale: float) -> torch.Tensor:
    """Rows `0..rows-1` of the static caches `[max_rows, G, KV, D]` get q/k/v `[rows * n, ., D]` (row-major:
    row r's positions pos..pos+n-1) written at pos..pos+n-1; each query attends causally to its row's
    positions 0..its own. Returns `[rows * n, H, D]`."""
    return _launch(q, k, v, k_cache, v_cache, scale, rows, q.shape[0] // rows, pos)
