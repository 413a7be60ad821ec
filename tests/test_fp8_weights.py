"""FP8 weights (`quantization: fp8` / `fp8-all`, layers/fp8.py): the per-row E4M3 round trip, which modules of a tiny
thinker and talker are quantised (fp8: the routed experts; fp8-all: merged q/k/v and gate/up as one weight too), their bytes (the meta count the memory check uses
and the full-size target), the deploy key and the serve flag. The kernels: test_fp8_kernels.py."""

from __future__ import annotations

import argparse
import json
import re

import pytest
import torch

from omnistage.config import ConfigError
from omnistage.config_loader import build_deploy_config
from omnistage.layers import fp8
from omnistage.layers.moe import FusedExperts, experts_on_meta
from omnistage.models.qwen3_omni.decoder import fuse_projections, quantize_fp8
from omnistage.models.qwen3_omni.make_tiny import tiny_checkpoint
from omnistage.models.qwen3_omni.model import FULL_SIZE_CONFIG, build_stage, load_config, quantize_stage
from omnistage.pipeline.placement.sizing import module_bytes, weight_bytes
from omnistage.server.launch import deploy_config, deploy_overrides
from omnistage.server.serve_args import add_serve_args

# fp8: the routed experts; fp8-all: the decoders' projections too; nothing else (embeddings, norms, routers, heads)
QUANTISED = {"fp8": re.compile(r"model\.layers\.\d+\.mlp\.experts\.(gate_up|down)_proj"),
             "fp8-all": re.compile(r"(code_predictor\.)?model\.layers\.\d+\.(self_attn\.[qkvo]_proj\.weight|"
                                   r"mlp\.(shared_expert\.)?(gate|up|down)_proj\.weight|mlp\.experts\.(gate_up|down)_proj)")}


def test_round_trip_within_e4m3_rounding() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 40, 96, generator=g) * torch.logspace(-3, 2, 40)[None, :, None]
    w[0, 5] = 0.0
    w[1, 7, ::3] = 0.0
    q, scale = fp8.quantize_rows(w)
    assert (q.dtype, q.shape, scale.dtype, scale.shape) == (fp8.FP8, w.shape, torch.float32, (3, 40))
    back = fp8.dequantize(q, scale, torch.float32)
    assert torch.equal(back[w == 0], w[w == 0]) and torch.equal(back[0, 5], torch.zeros(96))
    # 3 mantissa bits: within 2^-4 of each value; below E4M3's normal range (2^-6 of a scale) 2^-10 of the scale
    bound = torch.maximum(w.abs() * 2**-4, scale[..., None] * 2**-10)
    assert ((back - w).abs() <= bound * (1 + 1e-6)).all()
    assert torch.allclose(back.abs().amax(-1), w.abs().amax(-1), rtol=1e-6)  # each row's amax is 448 x scale


@torch.inference_mode()
@pytest.mark.parametrize("quantization", ["fp8", "fp8-all"])
@pytest.mark.parametrize("stage", ["thinker", "talker"])
def test_what_is_quantised(stage: str, quantization: str) -> None:
    d = tiny_checkpoint("tiny")
    plain = build_stage(load_config(d), stage, model_dir=d)
    ours = build_stage(load_config(d), stage, model_dir=d, quantization=quantization)
    params = dict(ours.named_parameters())
    fp8_names = {n for n, p in params.items() if p.dtype == fp8.FP8}
    layers = len(ours.model.layers)
    assert fp8_names == {n for n in params if QUANTISED[quantization].fullmatch(n)} and len(fp8_names) >= 2 * layers
    dense = quantization == "fp8-all"
    assert any(".shared_expert." in n for n in fp8_names) == (stage == "talker" and dense)
    assert any(n.startswith("code_predictor.") for n in fp8_names) == (stage == "talker" and dense)
    buffers = dict(ours.named_buffers())
    for n in fp8_names:
        scale = buffers[n.replace(".weight", ".weight_scale") if n.endswith(".weight") else n[:-5] + "_scale"]
        assert scale.dtype == torch.float32 and scale.shape == params[n].shape[:-1]
    plain_params = dict(plain.named_parameters())
    for n in set(params) - fp8_names:
        assert torch.equal(params[n], plain_params[n]), n
    quantised = [p for n, p in plain_params.items() if n in fp8_names]
    bf16 = sum(p.numel() * 2 for p in quantised)
    ours_bytes = sum(params[n].numel() + buffers[k].numel() * 4 for n in fp8_names
                     for k in [n.replace(".weight", ".weight_scale") if n.endswith(".weight") else n[:-5] + "_scale"])
    assert 0.5 < ours_bytes / bf16 < 0.63  # 1 byte per weight + 4 per row (tiny rows: 16-64 weights)
    # the memory check's count on the meta device is the module's own
    assert weight_bytes(load_config(d), stage, torch.float32, quantization) == module_bytes(ours)


@torch.inference_mode()
@pytest.mark.parametrize("load_format", ["auto", "dummy"])
@pytest.mark.parametrize("quantization", ["fp8", "fp8-all"])
def test_experts_quantised_as_they_load_equal_quantised_after(quantization: str, load_format: str) -> None:
    """`build_stage` makes the experts in FP8 and quantises each tensor as it loads (never the whole stage in its
    dtype): the same bytes as loading in the dtype and quantising after."""
    d = tiny_checkpoint("tiny")
    for stage in ("thinker", "talker"):
        kw = {"model_dir": d, "load_format": load_format, "dtype": torch.bfloat16}  # NOTE: the checkpoint is fp32
        ours = build_stage(load_config(d), stage, quantization=quantization, **kw)
        after = quantize_stage(build_stage(load_config(d), stage, **kw), quantization)
        a, b = ours.state_dict(), after.state_dict()
        assert a.keys() == b.keys()
        for k, v in a.items():
            assert v.dtype == b[k].dtype and torch.equal(v.view(torch.uint8) if v.dtype == fp8.FP8 else v,
                                                         b[k].view(torch.uint8) if v.dtype == fp8.FP8 else b[k]), k
    with experts_on_meta():
        experts = FusedExperts(4, 16, 8)
    assert experts.gate_up_proj.is_meta and experts.down_proj.is_meta  # no storage in the stage's dtype


@torch.inference_mode()
def test_merged_weights_are_quantised_per_row_as_views() -> None:
    d = tiny_checkpoint("tiny")
    apart = build_stage(load_config(d), "talker", model_dir=d, quantization="fp8-all")
    merged = build_stage(load_config(d), "talker", model_dir=d)
    fuse_projections(merged)
    quantize_fp8(merged, dense=True)
    attn, shared = merged.model.layers[0].self_attn, merged.model.layers[0].mlp.shared_expert
    assert attn.qkv_weight.dtype == fp8.FP8 and attn.k_proj.weight.data_ptr() > attn.qkv_weight.data_ptr()
    assert attn.k_proj.weight_scale.data_ptr() > attn.qkv_scale.data_ptr()
    assert shared.up_proj.weight.untyped_storage().data_ptr() == shared.gate_up_weight.untyped_storage().data_ptr()
    apart_state, merged_state = apart.state_dict(), merged.state_dict()
    assert apart_state.keys() == merged_state.keys()
    for k, v in apart_state.items():  # rows are independent: merging does not change a value or a scale
        assert torch.equal(v.view(torch.uint8) if v.dtype == fp8.FP8 else v,
                           merged_state[k].view(torch.uint8) if v.dtype == fp8.FP8 else merged_state[k]), k


@pytest.mark.parametrize("quantization, total", [("fp8", 38_618_993_386), ("fp8-all", 37_494_936_298)])
def test_full_size_weights_fit_the_target(quantization: str, total: int) -> None:
    from transformers import Qwen3OmniMoeConfig

    config = Qwen3OmniMoeConfig.from_dict(json.loads(FULL_SIZE_CONFIG.read_text()))
    ours = sum(weight_bytes(config, s, torch.bfloat16, quantization) for s in ("thinker", "talker"))
    ours += weight_bytes(config, "code2wav", torch.bfloat16)
    assert ours == total  # < 40 GB; bf16: 70.52 GB (test_memory_budget)


def test_deploy_key_and_its_checks() -> None:
    cfg = build_deploy_config({"stages": {"thinker": {"quantization": "fp8"}}}, "cpu")
    assert (cfg.stages.thinker.quantization, cfg.stages.talker.quantization) == ("fp8", None)
    with pytest.raises(ConfigError, match="stages.code2wav.quantization: only the thinker and the talker"):
        build_deploy_config({"stages": {"code2wav": {"quantization": "fp8"}}}, "cpu")
    with pytest.raises(ConfigError, match="stages.talker.quantization: must be null or one of fp8, fp8-all, got 'int8'"):
        build_deploy_config({"stages": {"talker": {"quantization": "int8"}}}, "cpu")


def test_serve_flag_sets_thinker_and_talker(tiny_dir) -> None:
    parser = add_serve_args(argparse.ArgumentParser())
    args = parser.parse_args(["--quantization", "fp8"])
    cfg = deploy_config(tiny_dir, None, None, "cpu", deploy_overrides(args))
    assert [cfg.stage(s).quantization for s in ("thinker", "talker", "code2wav")] == ["fp8", "fp8", None]
    cfg = deploy_config(tiny_dir, None, '{"talker": {"quantization": null}}', "cpu", deploy_overrides(args))
    assert (cfg.stages.thinker.quantization, cfg.stages.talker.quantization) == ("fp8", None)
    assert deploy_config(tiny_dir, None, None, "cpu", deploy_overrides(parser.parse_args([]))).stages.thinker.quantization is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "int8"])
