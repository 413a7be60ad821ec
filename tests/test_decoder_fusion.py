"""The decoder's residual stream carried beside the hidden (vLLM-style), each add fused with the norm after it
(`norm.add_rms_norm`): the reference path adds and rounds exactly as the plain layer loop, and the fast path (Triton's
interpreter on the CPU, conftest) launches one fused kernel per norm after the first, for any layer count and with
captured layers and DeepStack rows, where the stream is materialised."""

from __future__ import annotations

import pytest
import torch
from conftest import KERNEL_DEVICE as DEV

from omnistage.layers import triton_norm, triton_ops
from omnistage.layers.attention import allocate_kv_cache
from omnistage.layers.context import build_context, forward_context
from omnistage.models.qwen3_omni.decoder import DecoderConfig, DecoderModel, Deepstack

pytestmark = pytest.mark.skipif(triton_ops.triton is None, reason="needs Triton")

T = 9


def _model(layers: int) -> DecoderModel:
    cfg = DecoderConfig(hidden_size=48, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, rope_theta=1e4, intermediate_size=80)
    torch.manual_seed(layers)
    model = DecoderModel(cfg).eval().requires_grad_(False)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.normal_(1.0, 0.2)
    model.to(DEV)
    allocate_kv_cache(model, 4, 4, torch.float32, DEV)
    return model


def _plain_loop(model: DecoderModel, x: torch.Tensor, capture_layer: int | None, deepstack: Deepstack | None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The layer loop as transformers writes it (each layer adds its attention and MLP to the hidden)."""
    cos, sin = model.rotary_emb(torch.arange(T, device=DEV), x.dtype)
    h, captured = x, (x if capture_layer == 0 else None)
    for i, layer in enumerate(model.layers):
        h = h + layer.self_attn(layer.input_layernorm(h), cos, sin)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        captured = h if capture_layer == i + 1 else captured
        if deepstack is not None and i < len(deepstack.embeds):
            h = h.index_add(0, deepstack.index, deepstack.embeds[i])
    h = model.norm(h)
    return h, (h if capture_layer == len(model.layers) else captured)


def _forward(model: DecoderModel, x: torch.Tensor, *args, plain: bool = False
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    with forward_context(build_context([0], [T], [list(range(4))], 4, DEV)):
        return _plain_loop(model, x, *args) if plain else model(x, torch.arange(T, device=DEV), *args)


def _count(monkeypatch, name: str) -> list[int]:
    kernel, calls = getattr(triton_norm, name), [0]

    class Counting:
        def __getitem__(self, grid):
            calls[0] += 1
            return kernel[grid]

    monkeypatch.setattr(triton_norm, name, Counting())
    return calls


@torch.no_grad()
@pytest.mark.parametrize("layers,capture_layer,deepstack_layers", [
    (1, None, 0), (3, None, 0), (3, 2, 0), (4, 4, 2), (3, 0, 3)])
def test_residual_stream(layers: int, capture_layer: int | None, deepstack_layers: int, monkeypatch) -> None:
    model = _model(layers)
    g = torch.Generator(DEV).manual_seed(layers)
    x = torch.randn(T, 48, device=DEV, generator=g)
    deepstack = Deepstack(torch.tensor([1, 4, 5], device=DEV),
                          [torch.randn(3, 48, device=DEV, generator=g) for _ in range(deepstack_layers)])
    args = (capture_layer, deepstack if deepstack_layers else None)
    monkeypatch.setattr(triton_ops, "fast_path", lambda t: False)  # the reference path, on CUDA too
    want, ref = _forward(model, x, *args, plain=True), _forward(model, x, *args)
    assert torch.equal(ref[0], want[0]) and (capture_layer is None or torch.equal(ref[1], want[1]))
    fused_norms = _count(monkeypatch, "_add_rms_norm_kernel")
    plain_norms = _count(monkeypatch, "_rms_norm_rope_kernel")
    monkeypatch.setattr(triton_ops, "fast_path", lambda t: True)
    got = _forward(model, x, *args)
    for a, b in zip(got, want):
        if b is not None:
            torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6)
    # the stream is materialised after each layer whose output is read (captured) or changed (DeepStack rows)
    materialised = len({*range(1, deepstack_layers + 1), capture_layer} - {None, 0})
    assert fused_norms[0] == 2 * layers - materialised
    assert plain_norms[0] == 1 + materialised + 2 * layers  # + the q and k norms (q/k/v unmerged here)
