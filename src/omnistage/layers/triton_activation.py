"""SwiGLU activation kernel (Triton) for the CUDA fast path (`layers.mlp.silu_mul` picks it).

`silu_mul(gate_up)` reads a fused gate/up GEMM output `[..., 2I]` (gate columns first) and writes
`silu(gate) * up` `[..., I]` in one kernel instead of chunk + silu + mul (two kernels, one temporary).
It rounds where eager bf16 rounds: torch's CUDA silu is `x / (1 + expf(-x))` in fp32 (IEEE division),
rounded to the dtype; the product is then computed in fp32 and rounded. Triton's `/` is an approximate
division, so the kernel divides with `libdevice.div_rn` and exponentiates with `libdevice.exp` (expf).
"""

from __future__ import annotations

import torch

from omnistage.layers import triton_ops, triton_pdl

if triton_ops.triton is not None:
    from omnistage.layers.triton_ops import libdevice, tl, triton
    from omnistage.layers.triton_pdl import gdc

    @triton.jit
    def silu_mul_rounded(gate, up, dt: tl.constexpr):
        """`silu(gate) * up` of fp32 blocks, rounded to `dt` where eager rounds: the silu, the product."""
        act = libdevice.div_rn(gate, 1.0 + libdevice.exp(-gate)).to(dt).to(tl.float32)
        return (act * up).to(dt)

    @triton.jit
    def _silu_mul_kernel(x_ptr, out_ptr, n, stride_row, BLOCK: tl.constexpr, PDL: tl.constexpr):
        gdc(PDL)
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = cols < n
        dt = out_ptr.dtype.element_ty
        src = row.to(tl.int64) * stride_row
        gate = tl.load(x_ptr + src + cols, mask=m, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + src + n + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(out_ptr + row.to(tl.int64) * n + cols, silu_mul_rounded(gate, up, dt), mask=m)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` of `gate_up [..., 2I]` (rows may be strided) -> contiguous `[..., I]`."""
    n = gate_up.shape[-1] // 2
    x = gate_up.reshape(-1, 2 * n)
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = x.new_empty(x.shape[0], n)
    block = min(1024, triton.next_power_of_2(n))
    _silu_mul_kernel[(x.shape[0], triton.cdiv(n, block))](x, out, n, x.stride(0), BLOCK=block, **triton_pdl.launch(x))
    return out.view(*gate_up.shape[:-1], n)
