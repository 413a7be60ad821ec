"""Fused elementwise kernels (Triton) for the CUDA fast path; `fast_path(x)` is the ONE switch.

Each kernel replaces a chain of eager ops and rounds exactly where the eager chain does (every bf16 op
of torch computes in fp32 and rounds its result), so the only difference from the reference is the
order of the RMSNorm sum. The talker's frame step (15 code-predictor passes of 5 layers) is bound by
kernel launches, not bytes: with these kernels it went from 21.1 to 11.7 ms at batch 1 (BENCHMARKS.md).
- `rms_norm(x, w, eps, cos, sin)`: RMSNorm over the last dim, then (with cos/sin) rotate-half RoPE;
  `rms_norm_qk` does a layer's q and k norms + RoPE in one kernel, reading (strided) rows of the fused
  qkv GEMM output in place.
- `snake_beta(x, alpha, beta)`: code2wav's SnakeBeta, one pass instead of five over the largest tensors.
- `race_argmax(scores, seeds, steps)`: a sampled draw (`layers.sampling`: hash noise, exponential race,
  argmax) in one kernel per row instead of the integer kernels over [B, vocab] (the talker's step: 4 762 ->
  3 498 kernels at batch 16 with it); exact (integer hash, the same libdevice logf as torch).
`OMNISTAGE_FUSED_OPS=0` turns the fast path off (ablation and A/B checks).
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # NOTE: CPU-only installs may lack Triton; the reference path runs there.
    triton = None
else:
    # NOTE: Triton's interpreter (TRITON_INTERPRET=1, the tests on a CPU) has no libdevice: numpy's math there.
    libdevice = tl.math if os.environ.get("TRITON_INTERPRET") == "1" else libdevice

ENABLED = os.environ.get("OMNISTAGE_FUSED_OPS", "1") != "0"


def fast_path(x: torch.Tensor) -> bool:
    """Fused kernels for CUDA floating tensors when Triton is present and not switched off."""
    return (ENABLED and triton is not None and x.is_cuda
            and x.dtype in (torch.bfloat16, torch.float16, torch.float32))


if triton is not None:
    @triton.jit
    def _rms_norm_rope_kernel(x_ptr, w_ptr, w2_ptr, cos_ptr, sin_ptr, out_ptr, out2_ptr, half, heads, split,
                              stride_t, stride_h, eps, ROPE: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)  # (token, head); heads < split: weight w, output out; the others w2, out2
        tok, head = row // heads, row % heads
        cols = tl.arange(0, BLOCK)
        m = cols < half
        # NOTE: `first` as a block, not a scalar: Triton 3.9's interpreter takes only block masks
        first = (cols * 0 + head) < split
        dt = out_ptr.dtype.element_ty
        src = tok.to(tl.int64) * stride_t + head * stride_h
        lo = tl.load(x_ptr + src + cols, mask=m, other=0.0).to(tl.float32)
        hi = tl.load(x_ptr + src + half + cols, mask=m, other=0.0).to(tl.float32)
        var = (tl.sum(lo * lo, 0) + tl.sum(hi * hi, 0)) / (2 * half)
        r = libdevice.rsqrt(var + eps)
        w, w2 = w_ptr + cols, w2_ptr + cols
        w_lo = tl.where(first, tl.load(w, mask=m), tl.load(w2, mask=m)).to(tl.float32)
        w_hi = tl.where(first, tl.load(w + half, mask=m), tl.load(w2 + half, mask=m)).to(tl.float32)
        y_lo = (w_lo * (lo * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        y_hi = (w_hi * (hi * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        if ROPE:
            t = tok.to(tl.int64) * half
            c = tl.load(cos_ptr + t + cols, mask=m, other=0.0).to(tl.float32)
            s = tl.load(sin_ptr + t + cols, mask=m, other=0.0).to(tl.float32)
            a, b = (y_lo * c).to(dt).to(tl.float32), (y_hi * s).to(dt).to(tl.float32)
            d, e = (y_hi * c).to(dt).to(tl.float32), (y_lo * s).to(dt).to(tl.float32)
            y_lo, y_hi = a - b, d + e
        # NOTE: both stores are masked by `first`; the clamped head keeps the masked-off address in bounds.
        dst = (tok.to(tl.int64) * split + tl.minimum(head, split - 1)) * 2 * half
        dst2 = (tok.to(tl.int64) * (heads - split) + tl.maximum(head - split, 0)) * 2 * half
        tl.store(out_ptr + dst + cols, y_lo.to(dt), mask=m & first)
        tl.store(out_ptr + dst + half + cols, y_hi.to(dt), mask=m & first)
        tl.store(out2_ptr + dst2 + cols, y_lo.to(dt), mask=m & ~first)
        tl.store(out2_ptr + dst2 + half + cols, y_hi.to(dt), mask=m & ~first)

    @triton.jit
    def _snake_beta_kernel(x_ptr, alpha_ptr, beta_ptr, out_ptr, length, channels, BLOCK: tl.constexpr):
        row = tl.program_id(0)  # (batch, channel)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = cols < length
        dt = out_ptr.dtype.element_ty
        ch = row % channels
        alpha = libdevice.exp(tl.load(alpha_ptr + ch).to(tl.float32)).to(dt).to(tl.float32)
        beta = libdevice.exp(tl.load(beta_ptr + ch).to(tl.float32)).to(dt).to(tl.float32)
        inv = (1.0 / (beta + 1e-9).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        base = row.to(tl.int64) * length
        x = tl.load(x_ptr + base + cols, mask=m, other=0.0).to(tl.float32)
        s = libdevice.sin((x * alpha).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        y = (inv * (s * s).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        tl.store(out_ptr + base + cols, (x + y).to(dt), mask=m)

    @triton.jit
    def _fmix32(x):
        x = x ^ (x >> 16)
        x = x * 0x85EBCA6B
        x = x ^ (x >> 13)
        x = x * 0xC2B2AE35
        return x ^ (x >> 16)

    @triton.jit
    def log_noise(seed, step, cols):
        """log E of `layers.sampling.exponential_noise` for token ids `cols` (int64 `seed`, `step`)."""
        lo, hi = (seed & 0xFFFFFFFF).to(tl.uint32), ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
        key = _fmix32(_fmix32(lo) ^ hi)
        key = _fmix32(key + (step & 0xFFFFFFFF).to(tl.uint32))
        h = _fmix32(_fmix32(key + cols.to(tl.uint32)) ^ _fmix32(key ^ 0x5BD1E995))
        u = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        return libdevice.log(-libdevice.log(u))

    @triton.jit
    def _race_argmax_kernel(x_ptr, seeds_ptr, steps_ptr, out_ptr, vocab: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        seed, step = tl.load(seeds_ptr + row), tl.load(steps_ptr + row)
        best, best_i = -float("inf"), 0
        for start in range(0, vocab, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            m = cols < vocab
            score = tl.load(x_ptr + row.to(tl.int64) * vocab + cols, mask=m, other=-float("inf"))
            score = tl.where(m, score - log_noise(seed, step, cols), -float("inf"))
            v, i = tl.max(score, 0, return_indices=True, return_indices_tie_break_left=True)
            best_i = tl.where(v > best, start + i, best_i)
            best = tl.maximum(best, v)
        tl.store(out_ptr + row, best_i.to(tl.int64))


def _norm_rows(x: torch.Tensor, weight: torch.Tensor, weight2: torch.Tensor, split: int, eps: float,
               cos: torch.Tensor | None, sin: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One launch over the rows of `x [T, heads, D]`: heads < split -> (weight, first output [T, split, D]),
    the others -> (weight2, second output [T, heads - split, D]). Rows are read through x's strides."""
    t, heads, d = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = x.new_empty(t, split, d)
    out2 = x.new_empty(t, heads - split, d) if heads > split else out
    rope = cos is not None
    if rope:
        cos, sin = cos.contiguous(), sin.contiguous()  # NOTE: no copy for `RotaryEmbedding`'s tables
    _rms_norm_rope_kernel[(t * heads,)](
        x, weight, weight2, cos if rope else x, sin if rope else x, out, out2, d // 2, heads, split,
        x.stride(0), x.stride(1), eps, ROPE=rope, BLOCK=triton.next_power_of_2(d // 2))
    return out, out2


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor | None = None,
             sin: torch.Tensor | None = None) -> torch.Tensor:
    """Fused RMSNorm over the last dim of `x` (rows may be strided); with `cos/sin [T, D/2]` and
    `x [T, heads, D]` also rotate-half RoPE. Returns a contiguous tensor."""
    x3 = x if cos is not None else x.reshape(-1, 1, x.shape[-1])
    return _norm_rows(x3, weight, weight, x3.shape[1], eps, cos, sin)[0].view(x.shape)


def rms_norm_qk(qk: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, num_q_heads: int,
                eps: float, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k heads of `qk [T, Hq + Hk, D]` (e.g. a slice of a fused qkv GEMM output, no copy) normed with
    their own weights, then RoPE, in one launch -> contiguous (q [T, Hq, D], k [T, Hk, D])."""
    return _norm_rows(qk, q_weight, k_weight, num_q_heads, eps, cos, sin)


def snake_beta(x: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """x + sin(x * e^alpha)^2 / (e^beta + 1e-9) per channel of `x [B, C, T]`, in one pass."""
    x = x.contiguous()
    b, c, t = x.shape
    out = torch.empty_like(x)
    block = 1024
    _snake_beta_kernel[(b * c, triton.cdiv(t, block))](x, alpha, beta, out, t, c, BLOCK=block)
    return out


def race_argmax(scores: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """`argmax(scores - log(exponential_noise(seeds, steps)))` per row of fp32 `scores [B, V]` -> [B] int64."""
    scores = scores.contiguous()
    out = torch.empty(scores.shape[0], dtype=torch.long, device=scores.device)
    _race_argmax_kernel[(scores.shape[0],)](scores, seeds.contiguous(), steps.contiguous(), out, scores.shape[1],
                                           BLOCK=1024)
    return out
