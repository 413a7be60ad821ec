"""Programmatic dependent launch (PDL, Hopper and later) for the decode steps' Triton kernels.

A kernel launched with PDL may start while the kernel before it on the stream still runs: its programs first wait
(`griddepcontrol.wait`) until that kernel has finished and its writes are visible, then let the next kernel start
(`griddepcontrol.launch_dependents`). In a CUDA graph of ~1 000 small kernels (a talker frame at batch 1) that is
to hide each launch behind the kernel before it. A kernel that takes it calls `gdc(PDL)` before it touches memory that
another kernel writes and is launched with `**launch(x)`; the kernels without it (torch's, cuBLAS's) wait for the
one before them as usual, so the two mix safely. On by default; `OMNISTAGE_PDL=0` turns it off (benchmarks/HISTORY.md,
49th section: the same bytes with and without on an H100, c = 1 RTF -12 %, c = 64 req/s +8 %).
"""

from __future__ import annotations

import functools
import os

import torch

from omnistage.layers import triton_ops

ENABLED = os.environ.get("OMNISTAGE_PDL", "1") != "0"
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


if triton_ops.triton is not None:
    from omnistage.layers.triton_ops import tl, triton

    @triton.jit
    def gdc(PDL: tl.constexpr):
        """First in a PDL kernel: wait for the kernel before it, then let the one after it start."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
