"""The shipped deploy layouts against the memory budget (pipeline/placement/memory.py): each loads for every
platform, the layout names and the flag, KV shares per device and per Ray actor, and the 80 GB layout on an
80 GB card with the real weights' bytes."""

from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen3OmniMoeConfig

from omnistage.config import DEPLOY_DIR, ConfigError
from omnistage.config_loader import load_deploy_config, resolve_deploy_config
from omnistage.models.qwen3_omni.model import FULL_SIZE_CONFIG
from omnistage.pipeline.placement.memory import GiB, DeviceMemory, StageMemory, plan_kv, relative_shares
from omnistage.server.launch import deploy_config, deploy_overrides
from omnistage.server.serve_args import add_serve_args

from test_memory_budget import CARD_80GB, TALKER_BLOCK, THINKER_BLOCK, MiB

STREAM = 1_297_472 * 2  # bytes of one code2wav stream's state (bf16), full size

@pytest.mark.parametrize("name, devices, util", [
    ("qwen3_omni_moe", (0, 0, 0), 0.9), ("80gb", (0, 0, 0), 0.95), ("2x80gb", (0, 1, 1), 0.9)])
def test_shipped_layouts_load_for_every_platform(tiny_dir, name, devices, util):
    path = resolve_deploy_config(tiny_dir, None if name == "qwen3_omni_moe" else name)
    file = f"{name}.yaml" if name == "qwen3_omni_moe" else f"qwen3_omni_moe_{name}.yaml"
    assert path == DEPLOY_DIR / file
    for platform in ("cuda", "cpu", "rocm", "xpu", "npu"):
        cfg = load_deploy_config(path, platform)
        assert tuple(cfg.stage(s).devices[0] for s in ("thinker", "talker", "code2wav")) == devices
        assert cfg.gpu_memory_utilization == util
    assert load_deploy_config(path, "cpu").stages.thinker.kv_cache_memory == 64 * MiB  # the platforms: merge


def test_layout_names_and_the_flag(tiny_dir, tmp_path):
    unknown = "no deploy config for model_type 'qwen3_omni_moe' and layout '40gb'"
    with pytest.raises(ConfigError, match=unknown):
        resolve_deploy_config(tiny_dir, "40gb")
    assert resolve_deploy_config(tiny_dir, str(tmp_path / "mine.yaml")) == tmp_path / "mine.yaml"
    args = add_serve_args(argparse.ArgumentParser()).parse_args(["--gpu-memory-utilization", "0.7",
                                                                 "--deploy-config", "80gb"])
    cfg = deploy_config(tiny_dir, args.deploy_config, None, "cpu", deploy_overrides(args))
    assert cfg.gpu_memory_utilization == 0.7 and cfg.stages.code2wav.max_batch_size == 64
    assert cfg.stages.code2wav.graph_batch_sizes() == [1, 2, 4, 8, 16] and cfg.stages.talker.max_batch_size == 64


def test_shares_per_device_locally_and_per_actor_with_ray():
    pytest.importorskip("ray")
    from omnistage.pipeline.placement.replica_host import build_order
    from omnistage.pipeline.placement.sizing import kv_shares

    one, two = (SimpleNamespace(deploy=load_deploy_config(DEPLOY_DIR / f, "cuda"))
                for f in ("qwen3_omni_moe.yaml", "qwen3_omni_moe_2x80gb.yaml"))
    keys = [("thinker", 0), ("talker", 0), ("code2wav", 0)]
    assert kv_shares(one, {k: 0 for k in keys}) == {("thinker", 0): 0.8, ("talker", 0): 0.2}
    assert kv_shares(two, {("thinker", 0): 0, ("talker", 0): 1, ("code2wav", 0): 1}) == {
        ("thinker", 0): 1.0, ("talker", 0): 1.0}
    replicas = [("thinker", 0, "thinker"), ("talker", 0, "talker0"), ("talker", 1, "talker1"),
                ("code2wav", 0, "code2wav")]
    assert build_order(replicas) == [replicas[3], replicas[0], replicas[1], replicas[2]]
    # the talker replica built last on its GPU takes all that is left there, the one before it half
    assert kv_shares(one, {("talker", 1): 0}) == {("talker", 1): 1.0}
    assert kv_shares(one, {("talker", 0): 0, ("talker", 1): 0}) == {("talker", 0): 0.5, ("talker", 1): 0.5}


def test_the_80gb_layout_fits_an_80gb_card_with_the_real_weights():
    from omnistage.pipeline.placement.sizing import largest_request, weight_bytes

    cfg = load_deploy_config(DEPLOY_DIR / "qwen3_omni_moe_80gb.yaml", "cuda")
    config = Qwen3OmniMoeConfig.from_dict(json.loads(FULL_SIZE_CONFIG.read_text()))
    weights = {s: weight_bytes(config, s, torch.bfloat16) for s in ("thinker", "talker", "code2wav")}
    # parameters and buffers (the rotary tables): 70.5 GB
    assert weights == {"thinker": 63_442_251_688, "talker": 6_649_206_016, "code2wav": 432_033_346}
    mem = DeviceMemory(CARD_80GB, CARD_80GB - 512 * MiB)  # our CUDA context held before we measure
    shares = relative_shares({s: cfg.stage(s).kv_cache_memory for s in ("thinker", "talker")})
    need = {s: -(-largest_request(cfg, s) // 16) + 1 for s in ("thinker", "talker")}
    block = {"thinker": THINKER_BLOCK, "talker": TALKER_BLOCK}
    paged = [StageMemory(s, weights[s], shares[s], block[s], need[s]) for s in ("thinker", "talker")]
    code2wav = StageMemory("code2wav", weights["code2wav"])
    # NOTE: 4 GiB for graphs, buffers and activations: code2wav's 16-stream graph ~1.6 GiB (6.2 GiB at 64 on
    # the H200), the thinker's and talker's pools ~1-2 GiB; the GPU run measures it.
    plans = plan_kv("cuda:0", mem, cfg.gpu_memory_utilization, [*paged, code2wav], 4 * GiB)
    assert [p.num_blocks * 16 for p in plans] == [44144, 52976]  # KV tokens: thinker, talker
    assert need == {"thinker": 257, "talker": 386}  # 2048 + 2048 tokens; 2048 + 9 + 4096 rows; + 1 padding
    at_90 = plan_kv("cuda:0", mem, 0.9, [*paged, code2wav], 4 * GiB)
    assert [p.num_blocks * 16 for p in at_90] == [9536, 11456]  # what 0.95 rather than 0.90 buys
    # an H100 measured 7.60 GiB (2026-12-05: 12 416 thinker tokens), 1 GiB of it the encoder caches at 512 MiB
    measured = int(7.60 * GiB) - 2 * 512 * MiB
    at_512, ours = (plan_kv("cuda:0", mem, cfg.gpu_memory_utilization, [*paged, code2wav], measured + 2 * mb * MiB)
                    for mb in (512, cfg.encoder_cache_mb))
    assert [p.num_blocks * 16 for p in at_512] == [12688, 15216]  # its log: 12 416, 14 896
    assert [p.num_blocks * 16 for p in ours] == [19232, 23088]  # at 128 an H100 measured 6.76 GiB, not 6.85
    # 64 code2wav stream slots rather than 16 (2026-12-05): 48 more rows of its stream state, 2.5 MiB each
    sixteen, slots = ([p.num_blocks * 16 for p in plan_kv("cuda:0", mem, cfg.gpu_memory_utilization, [*paged, code2wav],
                                                           int(6.76 * GiB) + k * 48 * STREAM)] for k in (0, 1))
    assert (sixteen, slots) == ([20016, 24032], [19008, 22816])  # its log at 16: 19 760 / 23 712


@pytest.mark.parametrize("gib, name, file", [
    (79.2, None, "qwen3_omni_moe_80gb.yaml"), (89.4, None, "qwen3_omni_moe_80gb.yaml"),
    (139.8, None, "qwen3_omni_moe.yaml"), (79.2, "2x80gb", "qwen3_omni_moe_2x80gb.yaml")])
def test_without_a_deploy_config_a_gpu_under_100_gib_gets_the_80gb_layout(tiny_dir, monkeypatch, gib, name, file):
    from omnistage.server import launch

    monkeypatch.setattr(launch, "detect_platform", lambda: "cuda")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=int(gib * GiB)))
    assert deploy_config(tiny_dir, name, None, None) == load_deploy_config(DEPLOY_DIR / file, "cuda")
    # the CPU asked for on a GPU machine: the default file, its cpu entry
    assert deploy_config(tiny_dir, None, None, "cpu") == load_deploy_config(DEPLOY_DIR / "qwen3_omni_moe.yaml", "cpu")
