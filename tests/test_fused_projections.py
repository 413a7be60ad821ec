"""Merged projections (one GEMM for q/k/v, for gate/up and for a router with its shared expert's gate,
`decoder.fuse_projections`) and the kernels that
read their outputs in place (`triton_norm.rms_norm_qk`, `triton_activation.silu_mul`): on the GPU, or in
Triton's interpreter on the CPU (conftest); fp32 there, bf16 with exactness checks on the GPU."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from conftest import KERNEL_DEVICE as DEV
from conftest import hf_reference, hf_stage_state
from transformers import Qwen3OmniMoeConfig

from omnistage.layers import triton_activation, triton_linear, triton_norm, triton_ops
from omnistage.layers.attention import allocate_kv_cache
from omnistage.layers.context import build_context, forward_context
from omnistage.layers.mlp import SwiGLUMLP
from omnistage.layers.moe import SparseMoeBlock
from omnistage.layers.norm import rms_norm_reference
from omnistage.layers.rotary import RotaryEmbedding, apply_rotary_emb
from omnistage.models.qwen3_omni.decoder import DecoderAttention, fuse_projections
from omnistage.models.qwen3_omni.model import build_stage, stage_module
from omnistage.models.qwen3_omni.presets import preset_config
from omnistage.models.qwen3_omni.weights import init_dummy_weights

pytestmark = pytest.mark.skipif(triton_ops.triton is None, reason="needs Triton")

EXACT = DEV == "cuda"  # NOTE: the interpreter truncates fp32 -> bf16 (test_triton_ops.py): bits on the GPU
DTYPE = torch.bfloat16 if EXACT else torch.float32
# NOTE: whole decoders are compared in fp32: in bf16 one rounding step can flip a MoE routing choice (seen on the
# H200: 5.5 % at one row of tiny-wide), which says nothing about the fusion; the kernels' bf16 bits are tested above.
TOL = 1e-4 if EXACT else 2e-6


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def _spy_kernel(monkeypatch, module, name: str) -> list[int]:
    """The data_ptr of the first argument of every launch of the Triton kernel `module.name`."""
    kernel, seen = getattr(module, name), []

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.append(args[0].data_ptr())
                return kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(module, name, Spy())
    return seen


@pytest.mark.parametrize("heads,kv_heads,d", [(4, 2, 16), (6, 3, 32), (16, 2, 128)])
def test_rms_norm_qk_reads_the_fused_output_in_place(heads: int, kv_heads: int, d: int, monkeypatch) -> None:
    g = torch.Generator(DEV).manual_seed(d)
    t, h = 11, 64
    w = torch.randn(d * (heads + 2 * kv_heads), h, device=DEV, generator=g).to(DTYPE) / 8
    qkv = F.linear(torch.randn(t, h, device=DEV, generator=g).to(DTYPE), w).view(t, -1, d)
    qw, kw = ((1 + 0.2 * torch.randn(d, device=DEV, generator=g)).to(DTYPE) for _ in range(2))
    cos, sin = RotaryEmbedding(d, 1e6).to(DEV)(torch.arange(40, 40 + t, device=DEV), DTYPE)
    launched = _spy_kernel(monkeypatch, triton_norm, "_rms_norm_rope_kernel")
    q, k = triton_norm.rms_norm_qk(qkv[:, :heads + kv_heads], qw, kw, heads, 1e-6, cos, sin)
    assert launched == [qkv.data_ptr()]  # one launch, on the GEMM output itself (no copy)
    # strided rows give the bits the one-weight kernel gives on contiguous copies (same arithmetic per row)
    assert torch.equal(q, triton_norm.rms_norm(qkv[:, :heads].contiguous(), qw, 1e-6, cos, sin))
    k_rows = qkv[:, heads:heads + kv_heads]
    assert torch.equal(k, triton_norm.rms_norm(k_rows.contiguous(), kw, 1e-6, cos, sin))
    for out, part, weight in ((q, qkv[:, :heads], qw), (k, k_rows, kw)):
        ref = apply_rotary_emb(rms_norm_reference(part, weight, 1e-6), cos, sin)
        assert rel(out, ref) <= (2 ** -7 if EXACT else 1e-6)
    hidden, hw = qkv.flatten(1)[:, 8:8 + h], (1 + 0.2 * torch.randn(h, device=DEV, generator=g)).to(DTYPE)
    assert torch.equal(triton_norm.rms_norm(hidden, hw, 1e-6),
                       triton_norm.rms_norm(hidden.contiguous(), hw, 1e-6))
    assert launched[3] == hidden.data_ptr()


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # the interpreter's numpy, for exp(1e4)
@pytest.mark.parametrize("shape", [(5, 96), (3, 7, 3000)])
def test_silu_mul_matches_eager(shape: tuple[int, ...], monkeypatch) -> None:
    g = torch.Generator(DEV).manual_seed(len(shape))
    wide = torch.randn(*shape[:-1], shape[-1] + 6, device=DEV, generator=g) * 4
    wide[..., 3:7] = torch.tensor([-100.0, 100.0, 0.0, -1e4], device=DEV)  # exp overflow / underflow paths
    gate_up = wide.to(DTYPE)[..., 3:3 + shape[-1]]  # strided rows
    gate, up = gate_up.chunk(2, dim=-1)
    launched = _spy_kernel(monkeypatch, triton_activation, "_silu_mul_kernel")
    fused, eager = triton_activation.silu_mul(gate_up), F.silu(gate) * up
    assert launched == [gate_up.data_ptr()]  # strided rows read in place
    if EXACT:
        assert torch.equal(fused, eager)  # eager's rounding: fp32 silu (expf, IEEE division), rounded; mul
    torch.testing.assert_close(fused, eager, rtol=1e-6, atol=1e-7)  # each value, not just the largest


@functools.cache
def _talker(preset: str) -> torch.nn.Module:
    talker = stage_module(Qwen3OmniMoeConfig(**preset_config(preset)), "talker").eval().requires_grad_(False)
    init_dummy_weights(talker, "talker", seed=3)
    return talker


def _pair(module: torch.nn.Module, dtype: torch.dtype = DTYPE) -> tuple[torch.nn.Module, torch.nn.Module]:
    ref = copy.deepcopy(module).to(DEV, dtype)
    fused = copy.deepcopy(ref)
    fuse_projections(fused)
    return ref, fused


def _count_linear(monkeypatch) -> list[int]:
    """GEMMs run: `F.linear` calls and skinny Triton GEMMs (`layers.linear.linear` on the fast path)."""
    calls = [0]

    def counting(fn):
        def wrapped(*args, **kwargs):
            calls[0] += 1
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(F, "linear", counting(F.linear))
    monkeypatch.setattr(triton_linear, "_launch", counting(triton_linear._launch))
    return calls


def _prefill_then_decode(model: torch.nn.Module, embeds: torch.Tensor) -> list[torch.Tensor]:
    """Two sequences (5 and 8 rows) prefilled, then one decode row each; the final hidden of both steps."""
    tables, block = [list(range(4)), list(range(4, 8))], 4
    allocate_kv_cache(model, 8, block, embeds.dtype, DEV)
    outs = []
    for done, new, rows, pos in (([0, 0], [5, 8], embeds[:13], [*range(5), *range(8)]),
                                 ([5, 8], [1, 1], embeds[13:], [5, 8])):
        with forward_context(build_context(done, new, tables, block, DEV)):
            outs.append(model(rows, torch.tensor(pos, device=DEV))[0])
    return outs


@torch.no_grad()
@pytest.mark.parametrize("kernels", [True, False])
def test_fused_talker_decoder_matches_unfused(preset: str, kernels: bool, monkeypatch) -> None:
    ref, fused = _pair(_talker(preset).model, torch.float32)
    g = torch.Generator().manual_seed(1)
    embeds = torch.randn(15, ref.config.hidden_size, generator=g).to(DEV)
    calls = _count_linear(monkeypatch)
    want = _prefill_then_decode(ref, embeds)
    unfused_calls, calls[0] = calls[0], 0
    monkeypatch.setattr(triton_ops, "fast_path", lambda x: kernels)  # the interpreter's kernels on the CPU
    got = _prefill_then_decode(fused, embeds)
    for a, b in zip(got, want):
        assert rel(a, b) < TOL
    # per layer and forward: q/k/v 3 -> 1 GEMM, shared expert gate/up 2 -> 1, router and shared expert gate 2 -> 1
    assert unfused_calls - calls[0] == 2 * len(ref.layers) * 4


@torch.no_grad()
def test_fused_code_predictor_matches_unfused(preset: str, monkeypatch) -> None:
    ref, fused = _pair(_talker(preset).code_predictor, torch.float32)
    rows, hidden = 3, ref.model.config.hidden_size
    x = torch.randn(rows * 3, hidden, generator=torch.Generator().manual_seed(2)).to(DEV)
    calls, outs = _count_linear(monkeypatch), []
    for i, cp in enumerate((ref, fused)):
        if i:
            monkeypatch.setattr(triton_ops, "fast_path", lambda x: True)
        cp.allocate_cache(rows)
        outs.append((cp._pass(x[:2 * rows], 0, rows), cp._pass(x[2 * rows:], 2, rows), calls[0]))
        calls[0] = 0
    (want0, want1, unfused_calls), (got0, got1, fused_calls) = outs
    assert rel(got0, want0) < TOL and rel(got1, want1) < TOL
    layers = len(ref.model.layers)
    assert (unfused_calls, fused_calls) == (2 * layers * 7, 2 * layers * 4)  # q,k,v,o,gate,up,down a layer


def _merged(module: torch.nn.Module) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    """(merged weight, the weights it holds) of every merged projection in `module`."""
    out = []
    for m in module.modules():
        if isinstance(m, DecoderAttention):
            out.append((m.qkv_weight, [m.q_proj.weight, m.k_proj.weight, m.v_proj.weight]))
        elif isinstance(m, SwiGLUMLP):
            out.append((m.gate_up_weight, [m.gate_proj.weight, m.up_proj.weight]))
        elif isinstance(m, SparseMoeBlock) and m.shared_expert is not None:
            out.append((m.router_weight, [m.gate.weight, m.shared_expert_gate.weight]))
    return out


@torch.no_grad()
def test_fused_module_holds_no_second_copy() -> None:
    module = copy.deepcopy(_talker("tiny")).to(DEV, DTYPE)
    before = torch.cuda.memory_allocated() if EXACT else 0
    param_bytes = sum(p.nbytes for p in module.parameters())
    fuse_projections(module)
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in module.parameters()}
    assert sum(storages.values()) == param_bytes  # every parameter byte stored once, nothing beside
    merged = _merged(module)
    assert len(merged) == 3 * len(module.model.layers) + 2 * len(module.code_predictor.model.layers)
    for weight, parts in merged:
        assert all(p.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr() for p in parts)
        assert weight.untyped_storage().nbytes() == sum(p.nbytes for p in parts)
        assert torch.equal(weight, torch.cat(parts))
    if EXACT:
        assert torch.cuda.memory_allocated() <= before


@torch.no_grad()
def test_loading_after_fusion_fills_the_merged_weights() -> None:
    module = copy.deepcopy(_talker("tiny")).to(DEV, DTYPE)
    fuse_projections(module)
    state = hf_stage_state(hf_reference("tiny"), "talker")
    module.load_state_dict(state, strict=True)
    names = {id(p): n for n, p in module.named_parameters()}
    for weight, parts in _merged(module):
        assert torch.equal(weight, torch.cat([state[names[id(p)]] for p in parts]).to(DEV, DTYPE))


def test_build_stage_fuses_on_cuda_only() -> None:
    config = Qwen3OmniMoeConfig(**preset_config("tiny"))
    module = build_stage(config, "talker", load_format="dummy", device=DEV, dtype=DTYPE, seed=3)
    merged = _merged(module)
    assert all((w is not None) == EXACT for w, _ in merged)
    if EXACT:
        assert all(torch.equal(w, torch.cat(parts)) for w, parts in merged)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@torch.no_grad()
def test_fused_code_predictor_pass_replays_in_a_cuda_graph() -> None:
    _, cp = _pair(_talker("tiny").code_predictor)
    rows = 4
    cp.allocate_cache(rows)
    x = torch.randn(rows, cp.model.config.hidden_size, device=DEV, dtype=DTYPE)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        cp._pass(x, 2, rows)  # warm-up: Triton compiles outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cp._pass(x, 2, rows)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert torch.equal(out, cp._pass(x, 2, rows))
