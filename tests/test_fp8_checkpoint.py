"""FP8 checkpoints as published (`fp8_checkpoint.py`): block-wise `weight_scale_inv` and per-channel / per-tensor
`weight_scale` dequantised exactly as `fp8 x scale`, pairs found in any order, a lone half refused; and a tiny
checkpoint written that way (the thinker's and talker's projections and experts in E4M3 blocks) loads with every
such weight equal to its dequantised value and the model's logits close to the original's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from omnistage.models.qwen3_omni.fp8_checkpoint import dequantize, dequantized
from omnistage.models.qwen3_omni.make_tiny import tiny_checkpoint

E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max


def quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """As the published checkpoints: each block's absmax to E4M3's largest, the inverse scale kept."""
    bo, bi = block
    rows, cols = -(-w.shape[0] // bo), -(-w.shape[1] // bi)
    pad = torch.zeros(rows * bo, cols * bi)
    pad[: w.shape[0], : w.shape[1]] = w
    amax = pad.view(rows, bo, cols, bi).abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale = amax / E4M3_MAX
    q = (pad.view(rows, bo, cols, bi) / scale[:, None, :, None]).view_as(pad)[: w.shape[0], : w.shape[1]]
    return q.to(torch.float8_e4m3fn), scale


def test_dequantize_blocks_channels_and_one_scale() -> None:
    w = torch.randn(40, 24)
    q, s = quantize_blocks(w, (16, 16))
    assert s.shape == (3, 2)
    ref = q.float().clone()
    for i in range(40):
        for j in range(24):
            ref[i, j] *= s[i // 16, j // 16]
    assert torch.equal(dequantize(q, s, (16, 16)), ref)
    assert (dequantize(q, s, (16, 16)) - w).abs().max() <= 0.07 * w.abs().max()  # E4M3: 3 mantissa bits
    channel = torch.rand(40) + 0.5
    assert torch.equal(dequantize(q, channel[:, None], None), q.float() * channel[:, None])
    assert torch.equal(dequantize(q, channel, None), q.float() * channel[:, None])
    assert torch.equal(dequantize(q, torch.tensor(0.25), None), q.float() * 0.25)
    with pytest.raises(ValueError, match="weight_block_size"):
        dequantize(q, s, None)
    with pytest.raises(ValueError, match="do not tile"):
        dequantize(q, s, (32, 16))


def test_pairs_in_any_order_and_lone_halves_refused() -> None:
    q, s = quantize_blocks(torch.randn(8, 8), (4, 4))
    plain = torch.ones(3)
    got = dict(dequantized(iter([("a.weight_scale_inv", s), ("n.weight", plain), ("a.weight", q),
                                 ("b.weight", q), ("b.input_scale", torch.tensor(1.0)),
                                 ("b.weight_scale", torch.tensor(2.0))]), (4, 4)))
    assert list(got) == ["n.weight", "a.weight", "b.weight"] and got["n.weight"] is plain
    assert torch.equal(got["a.weight"], dequantize(q, s, (4, 4))) and torch.equal(got["b.weight"], q.float() * 2)
    with pytest.raises(KeyError, match="without"):
        list(dequantized(iter([("a.weight", q)]), (4, 4)))
    with pytest.raises(KeyError, match="without"):
        list(dequantized(iter([("a.weight_scale_inv", s)]), (4, 4)))


def _quantized(name: str, t: torch.Tensor) -> bool:
    """The layers the published checkpoints quantise: the LLMs' projections and experts, not the routers."""
    return (name.startswith(("thinker.model.layers.", "talker.model.layers.")) and t.dim() == 2
            and name.endswith("_proj.weight"))


def write_fp8_copy(src: Path, dst: Path, block: tuple[int, int]) -> dict[str, torch.Tensor]:
    """`src` with its LLM projections in E4M3 blocks (one file); the dequantised values by name."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    tensors, expect = {}, {}
    for f in sorted(src.glob("*.safetensors")):
        with safe_open(str(f), "pt") as g:
            for k in g.keys():
                t = g.get_tensor(k)
                if _quantized(k, t):
                    tensors[k], tensors[k + "_scale_inv"] = quantize_blocks(t, block)
                    expect[k] = dequantize(tensors[k], tensors[k + "_scale_inv"], block)
                    assert (expect[k] - t).norm() <= 0.05 * t.norm(), k  # the quantisation error alone
                else:
                    tensors[k] = t
    save_file(tensors, str(dst / "model.safetensors"))
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    (dst / "config.json").write_text(json.dumps(config))
    return expect


@torch.inference_mode()
def test_a_block_fp8_tiny_checkpoint_loads(tmp_path: Path) -> None:
    from omnistage.models.qwen3_omni.model import build_stage, load_config

    src = tiny_checkpoint("tiny")
    expect = write_fp8_copy(src, tmp_path / "fp8", (16, 16))
    assert len(expect) > 100
    config = load_config(tmp_path / "fp8")
    for stage in ("thinker", "talker"):
        ours = build_stage(config, stage, model_dir=tmp_path / "fp8", device=torch.device("cpu"), dtype=torch.float32)
        ref = build_stage(config, stage, model_dir=src, device=torch.device("cpu"), dtype=torch.float32)
        state = ours.state_dict()
        for name, value in expect.items():
            if name.startswith(stage + ".") and ".experts." not in name:
                assert torch.equal(state[name[len(stage) + 1:]], value), name
        experts = [n for n in expect if n.startswith(stage + ".") and ".experts.0.gate_proj" in n]
        for n in experts:  # fused in memory: [E, 2I, H], expert 0's gate rows first
            fused = state[n.split(".experts.")[0][len(stage) + 1:] + ".experts.gate_up_proj"]
            assert torch.equal(fused[0, : expect[n].shape[0]], expect[n])
        if stage == "thinker":
            from test_thinker import fresh, run

            prompt = [1, 5, 9, 200, 7, 3, 11, 42]
            a, b = (m.compute_logits(run(m, fresh(m, 1, 16), [prompt]).hidden_states) for m in (ours, ref))
            cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
            # NOTE: E4M3 keeps 3 mantissa bits (each weight within 6 % of itself); through the tiny random model's
            # layers that measured 0.971-0.999 per position; a misplaced scale block gives far less
            assert cos.min() > 0.95 and cos.mean() > 0.98, cos


def test_block_scales_need_the_block_size(tmp_path: Path) -> None:
    from omnistage.models.qwen3_omni.model import build_stage, load_config

    write_fp8_copy(tiny_checkpoint("tiny"), tmp_path / "fp8", (16, 16))
    raw = json.loads((tmp_path / "fp8" / "config.json").read_text())
    del raw["quantization_config"]
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="weight_block_size"):  # read as plain numbers they would be wrong
        build_stage(load_config(tmp_path / "fp8"), "thinker", model_dir=tmp_path / "fp8", device=torch.device("cpu"), dtype=torch.float32)


def _config_with(tmp_path: Path, name: str, quantization_config: dict | None) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    config = {"model_type": "qwen3_omni_moe"}
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_which_checkpoints_are_published_in_fp8(tmp_path: Path) -> None:
    from omnistage.models.qwen3_omni.fp8_checkpoint import published_fp8

    fp8_group = {"group_0": {"weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}}
    int_group = {"group_0": {"weights": {"num_bits": 4, "type": "int", "strategy": "group"}}}
    cases = {"qwen": ({"quant_method": "fp8", "weight_block_size": [128, 128]}, True),
             "llm-compressor": ({"quant_method": "compressed-tensors", "config_groups": fp8_group}, True),
             "modelopt": ({"quant_method": "modelopt", "quant_algo": "FP8"}, True),
             "w4a16": ({"quant_method": "compressed-tensors", "config_groups": int_group}, False),
             "awq": ({"quant_method": "awq", "bits": 4}, False), "bf16": (None, False)}
    for name, (q, fp8) in cases.items():
        assert published_fp8(_config_with(tmp_path, name, q)) is fp8, name


def test_a_published_fp8_checkpoint_is_held_in_fp8(tmp_path: Path) -> None:
    from omnistage.config_loader import default_deploy_config, load_deploy_config
    from omnistage.entrypoints.omni import Omni
    from omnistage.models.qwen3_omni.fp8_checkpoint import with_checkpoint_quantization

    src = tiny_checkpoint("tiny")
    expect = write_fp8_copy(src, tmp_path / "fp8", (16, 16))
    deploy = load_deploy_config(default_deploy_config(src), "cpu")
    held = with_checkpoint_quantization(deploy, tmp_path / "fp8")
    assert [held.stage(s).quantization for s in ("thinker", "talker", "code2wav")] == ["fp8-all", "fp8-all", None]
    assert with_checkpoint_quantization(deploy, src) is deploy  # bf16 checkpoint: as it is
    talker_fp8 = {"stages": {"talker": {"quantization": "fp8"}}}
    named = load_deploy_config(default_deploy_config(src), "cpu", overrides=talker_fp8)
    assert with_checkpoint_quantization(named, tmp_path / "fp8").stage("talker").quantization == "fp8"  # named: kept

    omni = Omni(tmp_path / "fp8", device="cpu", dtype="float32")
    try:
        experts = omni.engine.thinker.thinker.model.layers[0].mlp.experts
        assert experts.gate_up_proj.dtype == torch.float8_e4m3fn
        gate = expect["thinker.model.layers.0.mlp.experts.1.gate_proj.weight"]
        scale = experts.gate_up_scale[1, : gate.shape[0]]
        held_values = experts.gate_up_proj[1, : gate.shape[0]].float().detach() * scale[:, None]
        # quantised again per row: each value within E4M3's rounding of the checkpoint's (2^-4 of itself, or
        # 2^-10 of its row's scale below the normal range), none exactly as a misplaced scale would be
        assert ((held_values - gate).abs() <= gate.abs() / 16 + scale[:, None] / 1024 + 1e-7).all()
        out = omni.chat([{"role": "user", "content": "Say hello"}], sampling={"temperature": 0.0, "max_tokens": 4},
                        talker_sampling={"max_frames": 4, "ignore_eos": True})
        assert out.codes.shape == (16, 4) and out.audio.size > 0
    finally:
        omni.engine.shutdown()
