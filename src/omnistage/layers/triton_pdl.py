"""Programmatic dependent launch (PDL, Hopper and later) for the decode steps' Triton kernels.

A kernel launched with PDL may start while the kernel before it on the stream still runs: its programs first wait
(`griddepcontrol.wait`) until that kernel has finished and its writes are visible, then let the next kernel start
(`griddepcontrol.launch_dependents`). In a CUDA graph of ~1 000 small kernels (a talker frame at batch 1) that is
to hide each launch behind the kernel before it. A kernel that takes it calls `gdc(PDL)` before it touches memory that
another kernel writes and is launched with `**launch(x)`; the kernels without it (torch's, cuBLAS's) wait for the
one before them as usual, so the two mix safely. `OMNISTAGE_PDL=1` turns it on, `OMNISTAGE_PDL=2` also lets the
skinny GEMMs start loading their weights (no kernel's output) into L2 before the wait, as CUTLASS's weight-prefetch
example does (benchmarks/HISTORY.md, 48th section: one server measured, its bytes not yet checked on a GPU).
"""

from __future__ import annotations

import functools
import os

import torch

from omnistage.layers import triton_ops

ENABLED = os.environ.get("OMNISTAGE_PDL", "0") in ("1", "2")
PREFETCH = os.environ.get("OMNISTAGE_PDL", "0") == "2"
_OFF = {"PDL": False}


@functools.cache
def _supported(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


def launch(x: torch.Tensor) -> dict[str, bool]:
    """Launch options of a PDL-taking kernel working on `x`: `PDL` (its constexpr) and `launch_pdl`, on where
    `ENABLED` and x lies on a Hopper-or-later GPU."""
    if not (ENABLED and x.is_cuda and _supported(x.device)):
        return _OFF
    return {"PDL": True, "launch_pdl": True}


def prefetch_lines(x: torch.Tensor, k: int, element_size: int) -> int:
    """Addresses a weight row of `k` elements gets in `prefetch_rows` (a power of two, at most 128 bytes apart) where
    a kernel on `x` prefetches its weights before its wait (`PREFETCH`, with PDL on); else 0."""
    if not (PREFETCH and launch(x)["PDL"]):
        return 0
    return triton_ops.triton.next_power_of_2(-(-k * element_size // 128))


if triton_ops.triton is not None:
    from omnistage.layers.triton_ops import tl, triton

    @triton.jit
    def gdc(PDL: tl.constexpr):
        """First in a PDL kernel: wait for the kernel before it, then let the one after it start."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def prefetch_rows(ptr, rows, row_m, stride, k0, K: tl.constexpr, LINES: tl.constexpr):
        """Starts loading elements k0 .. k0 + K of rows `rows` (where `row_m`) of the matrix at `ptr` (row stride
        `stride`) into L2: LINES addresses a row, K / LINES apart (`prefetch_lines`: at most a 128-byte line)."""
        ks = k0 + tl.arange(0, LINES) * (K // LINES)
        ptrs = tl.where(row_m[:, None], ptr + rows[:, None] * stride + ks[None, :], ptr)
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // dummy $0", "=r,l", [ptrs], dtype=tl.int32,
                                  is_pure=False, pack=1)
