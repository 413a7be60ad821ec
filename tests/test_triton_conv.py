"""Code2wav's decoder kernels (`layers.triton_conv`) against the torch ops they replace: on the GPU, or in Triton's
interpreter on the CPU (conftest); skipped without Triton."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from omnistage.layers import triton_conv, triton_ops

from conftest import KERNEL_DEVICE as DEV

pytestmark = pytest.mark.skipif(triton_ops.triton is None, reason="needs Triton")

# NOTE: the interpreter truncates fp32 -> bf16 where the GPU rounds to nearest: bf16 only on the GPU.
DTYPE = torch.bfloat16 if DEV == "cuda" else torch.float32


def _randn(*shape: int, scale: float = 1.0, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(DEV).manual_seed(seed)
    return (torch.randn(*shape, device=DEV, generator=g) * scale).to(DTYPE)


@pytest.mark.parametrize("x_bias", [False, True])
def test_bias_residual_rounds_as_eager(x_bias: bool) -> None:
    """x, as the first unit of a block reads it: the trimmed (strided) transposed-conv output and its pending bias."""
    full, y = _randn(3, 96, 2070, scale=3), _randn(3, 96, 2051, seed=1)
    x = full[..., 8:2059]
    bias, xb = _randn(96, seed=2), _randn(96, seed=3) if x_bias else None
    fused = triton_conv.bias_residual(x, y, bias, xb)
    ref = (x if xb is None else x + xb[:, None]) + (y + bias[:, None])
    assert fused.is_contiguous()
    assert torch.equal(fused, ref)


@pytest.mark.parametrize("channels", [96, 20])
def test_conv1d_out1_matches_cudnn(channels: int) -> None:
    """The decoder's last conv (C -> 1, k 7) over a conv input buffer (3 rows), also for C not a multiple of the
    channel block."""
    x, w, b = _randn(3, channels, 518, scale=2), _randn(1, channels, 7, scale=0.2, seed=1), _randn(1, seed=2)
    fused = triton_conv.conv1d_out1(x, w, b)
    ref = F.conv1d(x.float(), w.float(), b.float())
    assert fused.shape == (3, 1, 512) and fused.dtype == DTYPE
    tol = 2 ** -7 if DTYPE == torch.bfloat16 else 1e-5  # measured (fp32, 672 terms in sequence): 1.1e-6
    assert float((fused.float() - ref).abs().max()) <= float(ref.abs().max()) * tol


@pytest.mark.parametrize(("c_in", "c_out", "kernel", "dilation"), [(96, 96, 7, 9), (20, 24, 7, 3), (40, 136, 1, 1)])
def test_conv1d_matches_cudnn(c_in: int, c_out: int, kernel: int, dilation: int) -> None:
    """A residual unit's convs (k 7 at dilations 1 / 3 / 9, k 1) over a conv input buffer whose rows lie further
    apart than their length (as a saved context's), with channels that fill no tile."""
    n = 300 + (kernel - 1) * dilation
    x = _randn(2, c_in, n + 13, scale=2)[..., 13:]
    w = _randn(c_out, c_in, kernel, scale=0.1, seed=1)
    fused = triton_conv.conv1d(x, w, dilation)
    ref = F.conv1d(x.float(), w.float(), dilation=dilation)
    assert fused.shape == (2, c_out, 300) and fused.dtype == DTYPE and fused.is_contiguous()
    tol = 2 ** -7 if DTYPE == torch.bfloat16 else 1e-5  # measured (fp32 interpreter): <= 1e-6
    assert float((fused.float() - ref).abs().max()) <= float(ref.abs().max()) * tol
