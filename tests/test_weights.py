from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import hf_reference, hf_stage_state
from omnistage.models.qwen3_omni.make_tiny import tiny_checkpoint
from omnistage.models.qwen3_omni.model import FULL_SIZE_CONFIG, build_stage, load_config, stage_module
from omnistage.models.qwen3_omni.checkpoint_names import STAGES

FULL_CONFIG = FULL_SIZE_CONFIG


def _assert_same(module: torch.nn.Module, ref: dict[str, torch.Tensor]) -> None:
    ours = module.state_dict()
    assert set(ref) <= set(ours)
    for k, v in ref.items():
        assert torch.equal(ours[k], v), k


@pytest.mark.parametrize("stage", STAGES)
def test_make_tiny_load_round_trip(preset: str, stage: str) -> None:
    d = tiny_checkpoint(preset)
    config = load_config(d)
    loaded = build_stage(config, stage, model_dir=d)
    _assert_same(loaded, hf_stage_state(hf_reference(preset), stage))
    dummy = build_stage(config, stage, load_format="dummy")
    _assert_same(dummy, loaded.state_dict())


def test_save_pretrained_checkpoint_loads(tmp_path: Path) -> None:
    hf = hf_reference("tiny")
    hf.save_pretrained(tmp_path)
    config = load_config(tmp_path)
    for stage in STAGES:
        _assert_same(build_stage(config, stage, model_dir=tmp_path), hf_stage_state(hf, stage))


def test_missing_and_foreign_tensors_are_errors(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    src = tiny_checkpoint("tiny")
    shutil.copytree(src, tmp_path / "ckpt")
    d = tmp_path / "ckpt"
    index = json.loads((d / "model.safetensors.index.json").read_text())
    name = "code2wav.pre_transformer.norm.weight"
    shard = d / index["weight_map"][name]
    tensors = load_file(shard)
    tensors.pop(name)
    save_file(tensors, shard)
    config = load_config(d)
    with pytest.raises(KeyError, match="missing"):
        build_stage(config, "code2wav", model_dir=d)
    tensors["code2wav.not_a_tensor"] = torch.zeros(2)
    tensors[name] = torch.ones(config.code2wav_config.hidden_size)
    save_file(tensors, shard)
    with pytest.raises(KeyError, match="no place"):
        build_stage(config, "code2wav", model_dir=d)


def test_full_size_parameter_count_on_meta() -> None:
    from transformers import Qwen3OmniMoeConfig

    config = Qwen3OmniMoeConfig(**json.loads(FULL_CONFIG.read_text()))
    total = 0
    with torch.device("meta"):
        for stage in STAGES:
            total += sum(p.numel() for p in stage_module(config, stage).parameters())
    assert total == 35_259_818_545


def test_fused_expert_state_dict_loads(tmp_path: Path) -> None:
    """transformers' in-memory layout (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I],
    `thinker.model.language_model.*`) saved as it is loads to the same parameters as the per-expert
    checkpoint (older transformers, e.g. the GPU machine's 5.17, keep a module per expert: that layout then)."""
    from safetensors.torch import save_file

    state = hf_reference("tiny").state_dict()
    fused = "thinker.model.language_model.layers.0.mlp.experts.gate_up_proj"
    if fused in state:
        assert tuple(state[fused].shape) == (8, 2 * 32, 64)
    else:
        assert any(k.endswith("layers.0.mlp.experts.7.gate_proj.weight") for k in state)
    save_file({k: v.clone() for k, v in state.items()}, tmp_path / "model.safetensors")
    shutil.copy(tiny_checkpoint("tiny") / "config.json", tmp_path)
    config = load_config(tmp_path)
    for stage in STAGES:
        ours = build_stage(config, stage, model_dir=tmp_path).state_dict()
        per_expert = build_stage(config, stage, model_dir=tiny_checkpoint("tiny")).state_dict()
        assert ours.keys() == per_expert.keys()
        assert [k for k in ours if not torch.equal(ours[k], per_expert[k])] == []
