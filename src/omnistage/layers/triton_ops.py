"""Fused elementwise kernels (Triton) for the CUDA fast path; `fast_path(x)` is the ONE switch.

Each kernel replaces a chain of eager ops and rounds exactly where the eager chain does (every bf16 op
of torch computes in fp32 and rounds its result), so the only difference from the reference is the
order of the RMSNorm sum. The talker's frame step (15 code-predictor passes of 5 layers) is bound by
kernel launches, not bytes: with these kernels it went from 21.1 to 11.7 ms at batch 1
(benchmarks/HISTORY.md).
- RMSNorm kernels (+ RoPE for the q/k norms): `layers.triton_norm`.
- `snake_beta(x, alpha, beta, bias, out)`: code2wav's SnakeBeta, one pass instead of five over the largest tensors,
  with the preceding conv's bias add folded in, reading and writing strided views (`code2wav_fused`).
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
    def _snake_beta_kernel(x_ptr, alpha_ptr, beta_ptr, bias_ptr, out_ptr, length, channels, sxb, sxc, sxt, sob, soc,
                           sot, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)  # (batch, channel)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = cols < length
        dt = out_ptr.dtype.element_ty
        b, ch = (row // channels).to(tl.int64), row % channels
        alpha = libdevice.exp(tl.load(alpha_ptr + ch).to(tl.float32)).to(dt).to(tl.float32)
        beta = libdevice.exp(tl.load(beta_ptr + ch).to(tl.float32)).to(dt).to(tl.float32)
        inv = (1.0 / (beta + 1e-9).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        x = tl.load(x_ptr + b * sxb + ch.to(tl.int64) * sxc + cols * sxt, mask=m, other=0.0).to(tl.float32)
        if HAS_BIAS:
            x = (x + tl.load(bias_ptr + ch).to(tl.float32)).to(dt).to(tl.float32)
        s = libdevice.sin((x * alpha).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        y = (inv * (s * s).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        tl.store(out_ptr + b * sob + ch.to(tl.int64) * soc + cols * sot, (x + y).to(dt), mask=m)

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


def snake_beta(x: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor, bias: torch.Tensor | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """SnakeBeta of `x [B, C, T] (+ bias [C])`: x + sin(x * e^alpha)^2 / (e^beta + 1e-9) per channel, in one pass.
    `x` and `out` may be strided views (a trimmed conv output, the tail of a conv's input buffer); `out` defaults to a
    new contiguous tensor. With `bias`, `x + bias` is rounded first, as a conv's bias add rounds."""
    b, c, t = x.shape
    out = x.new_empty(b, c, t) if out is None else out
    block = 1024
    _snake_beta_kernel[(b * c, triton.cdiv(t, block))](x, alpha, beta, x if bias is None else bias, out, t, c,
                                                       *x.stride(), *out.stride(), HAS_BIAS=bias is not None,
                                                       BLOCK=block)
    return out


def race_argmax(scores: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """`argmax(scores - log(exponential_noise(seeds, steps)))` per row of fp32 `scores [B, V]` -> [B] int64."""
    scores = scores.contiguous()
    out = torch.empty(scores.shape[0], dtype=torch.long, device=scores.device)
    _race_argmax_kernel[(scores.shape[0],)](scores, seeds.contiguous(), steps.contiguous(), out, scores.shape[1],
                                           BLOCK=1024)
    return out
