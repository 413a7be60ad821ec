"""The skinny GEMMs of `layers.triton_linear` against `F.linear` (+ eager SwiGLU) and the path choice of
`layers.linear.linear` / `SwiGLUMLP`: on the GPU in bf16 (also at the real shapes), in Triton's interpreter on the
CPU in fp32 (conftest); skipped without Triton."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import KERNEL_DEVICE as DEV

from omnistage.layers import linear, mlp, triton_linear, triton_ops

pytestmark = pytest.mark.skipif(triton_ops.triton is None, reason="needs Triton")

GPU = DEV == "cuda"
DTYPE = torch.bfloat16 if GPU else torch.float32
TOL = dict(rtol=2e-2, atol=2e-2) if GPU else dict(rtol=1e-5, atol=1e-5)
ROWS = [1, 2, 5, 16, 17, 64]
# N not a multiple of BLOCK_N 32, K not a multiple of BLOCK_K 32 (fitted down to 16); real shapes on the GPU
SHAPES = [(80, 48)] + ([(4096, 1024), (1024, 3072), (2048, 4096)] if GPU else [])
GATED_SHAPES = [(96, 48)] + ([(6144, 1024), (1536, 1024)] if GPU else [])
# None: the heuristic; a 32-row tile (M tiles past 32); split-K 3 (the in-order reduce kernel)
TILES = [None, (32, 32, 32, 4, 2, 1), (16, 16, 16, 4, 2, 3)]


def spy(monkeypatch) -> dict[str, list]:
    """(grid, GATED, SPLIT_K) of each launch of the GEMM and the reduce kernel."""
    seen = {"_skinny_gemm_kernel": [], "_split_k_reduce_kernel": []}
    for name, launches in seen.items():
        kernel = getattr(triton_linear, name)

        class Spy:
            def __getitem__(self, grid, kernel=kernel, launches=launches):
                def launch(*args, **kwargs):
                    launches.append((grid, kwargs["GATED"], kwargs["SPLIT_K"]))
                    return kernel[grid](*args, **kwargs)
                return launch

        monkeypatch.setattr(triton_linear, name, Spy())
    return seen


def operands(m: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) * k**-0.5, torch.randn(n, generator=g)
    return x.to(DEV, DTYPE), w.to(DEV, DTYPE), b.to(DEV, DTYPE)


def use_tiles(monkeypatch, n: int, k: int, m: int, gated: bool, tiles: tuple | None) -> None:
    if tiles is not None:
        monkeypatch.setitem(triton_linear.CONFIGS, (n, k, triton_linear.m_bucket(m), gated), tiles)


@pytest.mark.parametrize("tiles", TILES)
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_f_linear(m: int, n: int, k: int, tiles: tuple | None, bias: bool, monkeypatch) -> None:
    x, w, b = operands(m, n, k, m + n)
    b = b if bias else None
    use_tiles(monkeypatch, n, k, m, False, tiles)
    launched = spy(monkeypatch)
    out = triton_linear.linear(x, w, b)
    assert out.shape == (m, n) and out.dtype == DTYPE
    torch.testing.assert_close(out.float(), F.linear(x, w, b).float(), **TOL)
    block_m, block_n, block_k, _, _, split = tiles or triton_linear.config(n, k, m, False)
    split = triton_linear._fit(k, block_k, split)[1]
    assert launched["_skinny_gemm_kernel"] == [((-(-m // block_m), -(-n // block_n), split), False, split)]
    assert launched["_split_k_reduce_kernel"] == ([((m, 1), False, split)] if split > 1 else [])


@pytest.mark.parametrize("tiles", TILES)
@pytest.mark.parametrize("n,k", GATED_SHAPES)
@pytest.mark.parametrize("m", ROWS)
def test_linear_silu_mul_matches_eager(m: int, n: int, k: int, tiles: tuple | None, monkeypatch) -> None:
    x, w, _ = operands(m, n, k, m * n)
    use_tiles(monkeypatch, n, k, m, True, tiles)
    launched = spy(monkeypatch)
    out = triton_linear.linear_silu_mul(x, w)
    assert out.shape == (m, n // 2) and out.dtype == DTYPE
    torch.testing.assert_close(out.float(), mlp.silu_mul(F.linear(x, w)).float(), **TOL)
    _, _, block_k, _, _, split = tiles or triton_linear.config(n, k, m, True)
    split = triton_linear._fit(k, block_k, split)[1]
    assert [g[1:] for g in launched["_skinny_gemm_kernel"]] == [(True, split)]
    assert len(launched["_split_k_reduce_kernel"]) == (split > 1)


def test_strided_rows() -> None:
    """Rows of a wider tensor (the code predictor's last position per row after its 2-position pass)."""
    x, w, _ = operands(6, 32, 64, 3)
    rows = x.view(3, 2, 64)[:, -1]
    torch.testing.assert_close(triton_linear.linear(rows, w).float(), F.linear(rows, w).float(), **TOL)


def test_supports(monkeypatch) -> None:
    rows, w, _ = operands(65, 48, 64, 4)
    x = rows[:4]
    monkeypatch.setattr(triton_ops, "fast_path", lambda t: True)
    assert triton_linear.supports(x, w) and triton_linear.supports(rows[:64], w) and triton_linear.supports(x[::2], w)
    half = torch.float16 if DTYPE != torch.float16 else torch.float32
    # one reason each: no rows, 65 rows, 1-D, 3-D, strided columns, strided weight, dtypes, K != weight's K,
    # K = 40, N = 40, 3-D weight
    refused = [(x[:0], w), (rows, w), (x[0], w), (x[None], w), (x[:, ::2], w[:, :32].contiguous()),
               (x[:, :32], w[:, ::2]), (x, w.to(half)), (x[:, :48], w), (x[:, :40], w[:, :40].contiguous()),
               (x, w[:40]), (x, w[None])]
    assert [triton_linear.supports(a, b) for a, b in refused] == [False] * len(refused)
    monkeypatch.setitem(triton_linear.CONFIGS, (48, 64, 16, False), None)  # rows <= 16 left to cuBLAS
    assert not triton_linear.supports(x, w)
    assert triton_linear.supports(x, w, gated=True) and triton_linear.supports(rows[:17], w)
    torch.testing.assert_close(triton_linear.linear(x, w).float(), F.linear(x, w).float(), **TOL)  # heuristic tiles
    monkeypatch.setattr(triton_linear, "ENABLED", False)
    assert not triton_linear.supports(rows[:17], w)
    monkeypatch.setattr(triton_linear, "ENABLED", True)
    monkeypatch.setattr(triton_ops, "fast_path", lambda t: False)
    assert not triton_linear.supports(x, w)


def test_linear_path_choice(monkeypatch) -> None:
    """`layers.linear.linear`: the kernel where it is supported (leading dims flattened), `F.linear` otherwise."""
    x, w, b = operands(65, 48, 64, 5)
    launched = spy(monkeypatch)["_skinny_gemm_kernel"]
    monkeypatch.setattr(triton_ops, "fast_path", lambda t: False)
    assert torch.equal(linear.linear(x, w, b), F.linear(x, w, b)) and not launched
    monkeypatch.setattr(triton_ops, "fast_path", lambda t: True)
    assert torch.equal(linear.linear(x, w, b), F.linear(x, w, b))  # 65 rows
    assert torch.equal(linear.linear(x[:5], w[:40], b[:40]), F.linear(x[:5], w[:40], b[:40]))  # N = 40
    assert not launched
    out = linear.linear(x[:6].view(2, 3, 64), w, b)
    assert len(launched) == 1 and out.shape == (2, 3, 48)
    torch.testing.assert_close(out.float(), F.linear(x[:6], w, b).view(2, 3, 48).float(), **TOL)
    torch.testing.assert_close(linear.linear(x[:5], w, b).float(), F.linear(x[:5], w, b).float(), **TOL)
    assert len(launched) == 2


@torch.no_grad()
def test_swiglu_mlp_path_choice(monkeypatch) -> None:
    """Fused SwiGLU: bit-identical to the merged GEMM + silu_mul + down_proj off the fast path; on it one gated
    kernel and one plain one, matching the unfused module."""
    torch.manual_seed(6)
    ref = mlp.SwiGLUMLP(64, 48).to(DEV, DTYPE)
    fused = copy.deepcopy(ref)
    fused.fuse_projections()
    x = operands(5, 1, 64, 6)[0]
    launched = spy(monkeypatch)["_skinny_gemm_kernel"]
    monkeypatch.setattr(triton_ops, "fast_path", lambda t: False)
    want = ref(x)
    assert torch.equal(fused(x), F.linear(mlp.silu_mul(F.linear(x, fused.gate_up_weight)), ref.down_proj.weight))
    monkeypatch.setattr(triton_ops, "fast_path", lambda t: True)
    got = fused(x)
    assert [g[1] for g in launched] == [True, False]
    torch.testing.assert_close(got.float(), want.float(), **TOL)
