"""Programmatic dependent launch (`layers.triton_pdl`): a decode step's kernels (add + RMSNorm, q/k norm + RoPE,
skinny GEMMs with and without split-K, the MoE's routing, align, experts and un-permute, the sampler) captured in one
CUDA graph give the same bytes with it as without, replay after replay with new inputs: a kernel that touched memory
before its wait would race with the one before it. On a Hopper GPU only; on the CPU, that it stays off."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from omnistage.layers import norm, triton_fused_moe, triton_linear, triton_moe, triton_pdl, triton_sampling
from omnistage.layers.sampling import SamplingTensors

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
H, E, INTER, V = 1024, 128, 384, 2048  # the talker's hidden, experts and expert width; the code predictor's vocabulary


def test_off_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(triton_pdl, "ENABLED", True)
    assert triton_pdl.launch(torch.zeros(1)) == {"PDL": False}


def _weights(g: torch.Generator) -> dict[str, torch.Tensor]:
    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, device="cuda", generator=g) / shape[-1] ** 0.5).to(torch.bfloat16)
    return {"norm": w(H) + 1, "qkv": w(4096, H), "q_norm": w(128) + 1, "k_norm": w(128) + 1, "router": w(E, H),
            "gate_up": w(E, 2 * INTER, H), "down": w(E, H, INTER), "down_split": w(H, 3 * H), "lm_head": w(V, H)}


def _step(x: torch.Tensor, res: torch.Tensor, w: dict, st: SamplingTensors, steps: torch.Tensor,
          cos: torch.Tensor, sin: torch.Tensor) -> list[torch.Tensor]:
    outs = []
    for _ in range(3):
        h, res = norm.add_rms_norm(x, res, w["norm"], 1e-6)
        qkv = triton_linear.linear(h, w["qkv"]).view(-1, 32, 128)
        q, k = norm.rms_norm_qk(qkv[:, :24], w["q_norm"], w["k_norm"], 16, 1e-6, cos, sin)
        weights, ids = triton_moe.route(triton_linear.linear(h, w["router"]), 6, True)
        x = triton_fused_moe.fused_moe(h + q.flatten(1)[:, :H], w["gate_up"], w["down"], weights, ids)
        x = triton_linear.linear(torch.cat([x, k.flatten(1), k.flatten(1)], 1)[:, :3 * H], w["down_split"])
        outs += [q, k, x, res]
    logits = triton_linear.linear(x, w["lm_head"]).float()
    return [*outs, triton_sampling.fused_sample(logits, st, steps)]


def _replays(pdl: bool, monkeypatch: pytest.MonkeyPatch, n: int = 20) -> list[torch.Tensor]:
    """The outputs of n replays with new inputs, PDL on or off."""
    monkeypatch.setattr(triton_pdl, "ENABLED", pdl)
    g = torch.Generator("cuda").manual_seed(0)
    w = _weights(g)
    x, res = torch.zeros(1, H, device="cuda", dtype=torch.bfloat16), torch.zeros(1, H, device="cuda",
                                                                                  dtype=torch.bfloat16)
    cos, sin = (torch.rand(1, 64, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
    st = SamplingTensors.build([SimpleNamespace(temperature=1.0, top_k=50, top_p=0.8)], [7], "cuda")
    steps = torch.zeros(1, dtype=torch.long, device="cuda")
    _step(x, res, w, st, steps, cos, sin)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = _step(x, res, w, st, steps, cos, sin)
    got = []
    for i in range(n):
        x.copy_(torch.randn(1, H, device="cuda", generator=g))
        res.copy_(torch.randn(1, H, device="cuda", generator=g))
        steps.fill_(i)
        graph.replay()
        got.append(torch.cat([o.flatten().float() for o in outs]).cpu())
    return got


@pytest.mark.skipif(not HOPPER, reason="PDL needs a Hopper (sm90+) GPU")
def test_graph_with_pdl_equals_without(monkeypatch: pytest.MonkeyPatch) -> None:
    without, with_pdl = _replays(False, monkeypatch), _replays(True, monkeypatch)
    assert len({tuple(t[-1:].tolist()) for t in without}) > 1  # the draws differ from replay to replay
    for a, b in zip(without, with_pdl, strict=True):
        assert torch.equal(a, b)
