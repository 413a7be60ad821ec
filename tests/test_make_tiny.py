from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from conftest import hf_reference
from safetensors import safe_open

from omnistage.models.qwen3_omni.checkpoint_io import INDEX_FILE, SINGLE_FILE, checkpoint_files
from omnistage.models.qwen3_omni.checkpoint_names import (
    checkpoint_tensors,
    checkpoint_to_hf_name,
    expert_slot,
)
from omnistage.models.qwen3_omni.make_tiny import (
    hf_parameter_shapes,
    main_make_tiny,
    make_tiny,
    tiny_checkpoint,
)
from omnistage.models.qwen3_omni.presets import preset_config


def read_checkpoint_file(file: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(file), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def read_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    return {k: v for file in checkpoint_files(path) for k, v in read_checkpoint_file(file).items()}


def file_hashes(path: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}


def test_names_round_trip_and_fuse_back():
    params = hf_parameter_shapes(preset_config("tiny"))
    nested = any(".language_model." in n for n, _ in params)
    seen = set()
    for hf_name, shape in params:
        fused = torch.randn(shape)
        rebuilt = torch.full_like(fused, float("nan"))
        for name, t in checkpoint_tensors(hf_name, fused):
            # transformers 5.24 nests `thinker.model.language_model`; 5.17 keeps checkpoint names in memory
            assert checkpoint_to_hf_name(name) == (hf_name if nested else checkpoint_to_hf_name(hf_name))
            assert name not in seen
            seen.add(name)
            slot = expert_slot(name)
            (rebuilt if slot is None else slot.view(rebuilt)).copy_(t)
        assert torch.equal(rebuilt, fused), hf_name
    # 4 thinker layers x 8 experts x 3 + 2 talker layers x 8 x 3 per-expert tensors
    assert sum(expert_slot(n) is not None for n in seen) == 4 * 8 * 3 + 2 * 8 * 3
    assert not any(".language_model." in n or "thinker.model.audio_tower" in n for n in seen)


def test_layout_and_values_equal_hf_save_pretrained(preset, tmp_path):
    """transformers 5.24's save_pretrained of the seeded reference writes exactly our names and bytes."""
    ours = read_checkpoint(tiny_checkpoint(preset))
    hf_reference(preset, 0).save_pretrained(tmp_path)
    theirs = read_checkpoint(tmp_path)
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[k], theirs[k]) and ours[k].dtype == torch.float32 for k in ours)
    assert "thinker.model.layers.0.mlp.experts.7.down_proj.weight" in ours
    assert "thinker.audio_tower.conv2d1.weight" in ours and "thinker.visual.pos_embed.weight" in ours


def test_from_pretrained_loads_identical_weights(preset):
    from transformers import AutoConfig, Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

    path = tiny_checkpoint(preset)
    assert isinstance(AutoConfig.from_pretrained(path), Qwen3OmniMoeConfig)
    model, info = Qwen3OmniMoeForConditionalGeneration.from_pretrained(path, output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}
    ref = hf_reference(preset, 0).state_dict()
    loaded = model.state_dict()
    assert loaded.keys() == ref.keys()
    assert [k for k in ref if not torch.equal(loaded[k], ref[k])] == []


def test_overrides_shard_and_load(tmp_path):
    from transformers import Qwen3OmniMoeForConditionalGeneration

    thinker_text = {"num_hidden_layers": 1, "num_experts": 5, "num_experts_per_tok": 1}
    overrides = {"thinker_config": {"text_config": thinker_text},
                 "talker_config": {"text_config": {"num_experts": 3, "num_hidden_layers": 1}},
                 "code2wav_config": {"num_hidden_layers": 1}}
    out = make_tiny(tmp_path / "m", seed=3, overrides=overrides, max_shard_bytes=30 * 10**6)
    config = json.loads((out / "config.json").read_text())
    assert config["thinker_config"]["text_config"]["hidden_size"] == 64  # preset values kept
    index = json.loads((out / INDEX_FILE).read_text())
    files = checkpoint_files(out)
    shard_tensors = [read_checkpoint_file(f) for f in files]
    # audio+vision | embed_tokens (38.9 MB, alone) | thinker layer+norm | lm_head (alone) | talker+code2wav
    assert [f.name for f in files] == [f"model-0000{i}-of-00005.safetensors" for i in range(1, 6)]
    assert [len(t) for t in shard_tensors][1::2] == [1, 1]
    assert all(sum(x.numel() * 4 for x in t.values()) <= 30 * 10**6 for t in shard_tensors if len(t) > 1)
    tensors = read_checkpoint(out)
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in tensors.values())
    assert sorted(index["weight_map"]) == sorted(tensors)
    assert sum(".mlp.experts." in n for n in tensors) == 1 * 5 * 3 + 1 * 3 * 3
    model, info = Qwen3OmniMoeForConditionalGeneration.from_pretrained(out, output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}
    loaded = {n: t for hf_name, p in model.named_parameters()
              for n, t in checkpoint_tensors(hf_name, p.detach())}
    assert loaded.keys() == tensors.keys() and all(torch.equal(loaded[k], tensors[k]) for k in tensors)
    gate_up = model.talker.model.layers[0].mlp.experts.gate_up_proj
    assert torch.equal(gate_up[2, 16:], tensors["talker.model.layers.0.mlp.experts.2.up_proj.weight"])


def test_deterministic_bytes_and_seed(tmp_path):
    a, b = make_tiny(tmp_path / "a", seed=0), make_tiny(tmp_path / "b", seed=0)
    assert file_hashes(a) == file_hashes(b)
    assert file_hashes(a) == file_hashes(tiny_checkpoint("tiny", 0))
    c = make_tiny(tmp_path / "c", seed=1, max_shard_bytes=10**12)
    assert (c / SINGLE_FILE).exists() and not (c / INDEX_FILE).exists()
    ta, tc = read_checkpoint(a), read_checkpoint(c)
    assert ta.keys() == tc.keys()
    assert not torch.equal(ta["thinker.lm_head.weight"], tc["thinker.lm_head.weight"])


def test_tiny_checkpoint_cache(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OMNISTAGE_CACHE_DIR", str(tmp_path / "cache"))
    first = tiny_checkpoint("tiny", 5)
    stamp = (first / "config.json").stat().st_mtime_ns
    assert tiny_checkpoint("tiny", 5) == first and (first / "config.json").stat().st_mtime_ns == stamp
    assert first.parent == tmp_path / "cache" / "tiny" and first.name.startswith("tiny-5-")
    assert main_make_tiny([str(tmp_path / "cli"), "--seed", "5"]) == 0
    assert file_hashes(tmp_path / "cli") == file_hashes(first)
    assert "wrote" in capsys.readouterr().out


# The real Qwen/Qwen3-Omni-30B-A3B-Instruct's files besides the weights (its generation_config.json whole)
REAL_SIDE_FILES = ["chat_template.json", "config.json", "generation_config.json", "merges.txt",
                   "preprocessor_config.json", "tokenizer_config.json", "vocab.json"]
REAL_GENERATION_CONFIG = {"talker_max_new_tokens": 4096, "talker_repetition_penalty": 1.05,
                          "talker_temperature": 0.9, "talker_top_k": 50, "talker_top_p": 1.0}


def test_real_repo_file_set_and_processor_values(tiny_dir):
    from transformers import AutoFeatureExtractor, GenerationConfig, WhisperFeatureExtractor

    assert sorted(f.name for f in tiny_dir.iterdir() if f.suffix != ".safetensors") == sorted(
        [*REAL_SIDE_FILES, INDEX_FILE])
    assert json.loads((tiny_dir / "generation_config.json").read_text()) == REAL_GENERATION_CONFIG
    assert GenerationConfig.from_pretrained(tiny_dir).talker_temperature == 0.9
    pre = json.loads((tiny_dir / "preprocessor_config.json").read_text())
    assert (pre["min_pixels"], pre["max_pixels"], pre["patch_size"], pre["n_samples"]) == (
        3136, 12845056, 16, 4800000)
    assert "chat_template" not in json.loads((tiny_dir / "tokenizer_config.json").read_text())
    fe = AutoFeatureExtractor.from_pretrained(tiny_dir)
    assert type(fe) is WhisperFeatureExtractor
    assert (fe.feature_size, fe.sampling_rate, fe.hop_length) == (128, 16000, 160)


def test_image_processor_matches_vision_config(tiny_dir):
    pytest.importorskip("PIL")
    import numpy as np
    from transformers import AutoImageProcessor

    ip = AutoImageProcessor.from_pretrained(tiny_dir)
    assert (ip.patch_size, ip.merge_size, ip.temporal_patch_size) == (16, 2, 2)
    assert ip.size == {"shortest_edge": 3136, "longest_edge": 12845056}
    image = np.random.default_rng(0).integers(0, 255, (256, 256, 3), dtype=np.uint8)
    out = ip(images=[image], return_tensors="pt")
    assert out.image_grid_thw.tolist() == [[1, 16, 16]]  # 256 px / 16 px patches
    assert tuple(out.pixel_values.shape) == (256, 3 * 2 * 16 * 16)


def test_auto_processor_expands_audio_pads(tiny_dir):
    """Needs torchvision (transformers' video processor), absent beside torch 2.13 CPU: GPU machine."""
    pytest.importorskip("torchvision")
    import numpy as np
    from transformers import AutoProcessor
    from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import _get_feat_extract_output_lengths

    processor = AutoProcessor.from_pretrained(tiny_dir)
    assert type(processor).__name__ == "Qwen3OmniMoeProcessor"
    assert (processor.image_processor.patch_size, processor.video_processor.temporal_patch_size) == (16, 2)
    wav = (0.3 * np.sin(2 * np.pi * 220 * np.arange(32000) / 16000)).astype(np.float32)  # 2 s at 16 kHz
    parts = [{"type": "audio", "audio": wav}, {"type": "text", "text": "Hi"}]
    conversation = [{"role": "user", "content": parts}]
    text = processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    assert text == ("<|im_start|>user\n<|audio_start|><|audio_pad|><|audio_end|>Hi<|im_end|>\n"
                    "<|im_start|>assistant\n")
    out = processor(text=[text], audio=[wav], return_tensors="pt")
    n = int(_get_feat_extract_output_lengths(out["feature_attention_mask"].sum(-1), 50)[0])
    assert n == 26 and tuple(out["input_features"].shape) == (1, 128, 200)
    ids = out["input_ids"][0].tolist()
    assert ids == [151644, 872, 198, 151669] + [151675] * n + [151670, 13048, 151645, 198, 151644, 77091, 198]
