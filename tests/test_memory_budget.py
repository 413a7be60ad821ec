"""The memory budget (pipeline/placement/memory.py) with the device memory as parameters, the CUDA sizing steps
with the allocator faked, and the start-up log's KV lines agreeing with the engine's too-long refusal. The shipped
layouts against it: test_memory_layouts.py."""

from __future__ import annotations

import argparse
import logging
from types import SimpleNamespace

import pytest
import torch

from omnistage.config import DEPLOY_DIR
from omnistage.config_loader import load_deploy_config, resolve_deploy_config
from omnistage.models.qwen3_omni.model import load_config
from omnistage.pipeline.placement.memory import (GiB, DeviceMemory, KVPlan, MemoryBudgetError, StageMemory,
                                                 check_weights, kv_summary, plan_kv, relative_shares)
from omnistage.server.serve_args import add_serve_args

MiB = 1 << 20
THINKER_BLOCK = 16 * 96 * 1024  # 16 tokens x 96 KiB (the full-size thinker)
TALKER_BLOCK = 16 * 20 * 1024
CARD_80GB = 85_031_714_816  # what an 80 GB H100 reports (79.19 GiB)


def stages(thinker_kv: float | int = 0.8, talker_kv: float | int = 0.2, min_blocks: int = 1):
    return [StageMemory("thinker", 50 * GiB, thinker_kv, THINKER_BLOCK, min_blocks),
            StageMemory("talker", 10 * GiB, talker_kv, TALKER_BLOCK, min_blocks),
            StageMemory("code2wav", GiB)]


def test_the_rest_is_split_by_relative_shares():
    # budget 0.9 x 100 GiB = 90 GiB; 61 GiB of weights, 5 GiB measured: 24 GiB of KV, 80 / 20
    plans = plan_kv("cuda:0", DeviceMemory(100 * GiB, 100 * GiB), 0.9, stages(), 5 * GiB)
    assert plans == [KVPlan("thinker", 13107, 13107 * THINKER_BLOCK),
                     KVPlan("talker", 15728, 15728 * TALKER_BLOCK)]
    assert relative_shares({"thinker": 0.25, "talker": 0.05, "x": 4096}) == {
        "thinker": 0.25 / 0.3, "talker": 0.05 / 0.3, "x": 4096}
    # memory other processes hold counts against the budget: 20 GiB held, 4 GiB of KV left
    held = plan_kv("cuda:0", DeviceMemory(100 * GiB, 80 * GiB), 0.9, stages(), 5 * GiB)
    assert [p.num_blocks for p in held] == [2184, 2621]


def test_pinned_bytes_come_first_and_the_floats_share_the_rest():
    plans = plan_kv("cuda:0", DeviceMemory(100 * GiB, 100 * GiB), 0.9, stages(1.0, GiB), 5 * GiB)
    assert plans == [KVPlan("thinker", 15701, 15701 * THINKER_BLOCK),
                     KVPlan("talker", 3276, 3276 * TALKER_BLOCK)]
    assert 15701 * THINKER_BLOCK <= 23 * GiB < 15702 * THINKER_BLOCK


def test_weights_that_do_not_fit_are_refused_before_loading():
    mem = DeviceMemory(CARD_80GB, CARD_80GB - 512 * MiB)
    full = [StageMemory("thinker", 63_438_410_976), StageMemory("talker", 6_649_192_960),
            StageMemory("code2wav", 432_033_154)]
    check_weights("cuda:0", mem, 0.95, full)  # 65.68 GiB into 74.73 GiB
    with pytest.raises(MemoryBudgetError) as e:
        check_weights("cuda:0", mem, 0.8, full)
    assert str(e.value) == (
        "cuda:0: the weights need 65.68 GiB (thinker 59.08 GiB, talker 6.19 GiB, code2wav 0.40 GiB) but "
        "62.85 GiB may be used (0.80 x 79.19 GiB total - 0.50 GiB held by other processes). Options: on one "
        "80 GB card, --deploy-config 80gb (smaller CUDA-graph sets, batches and caches); spread the stages "
        "over more GPUs (--deploy-config 2x80gb: the thinker on GPU 0, the talker and code2wav on GPU 1); "
        "raise --gpu-memory-utilization (now 0.80) if nothing else needs the card; free the memory other "
        "processes hold; smaller KV caches (kv_cache_memory in bytes), CUDA-graph sets and max_batch_size in "
        "the deploy config; FP8 weights for the thinker and talker (--quantization fp8).")


def test_too_little_kv_for_one_request_is_refused_with_the_numbers():
    mem = DeviceMemory(100 * GiB, 100 * GiB)
    with pytest.raises(MemoryBudgetError) as e:  # 90 - 61 - 28.5: 0.5 GiB of KV, the thinker needs 384 blocks
        plan_kv("cuda:0", mem, 0.9, stages(min_blocks=384), 28 * GiB + 512 * MiB)
    assert str(e.value).startswith(
        "cuda:0: 90.00 GiB may be used (0.90 x 100.00 GiB total - 0.00 GiB held by other processes); after "
        "the weights (61.00 GiB) and the CUDA graphs, buffers and activations (28.50 GiB) 0.50 GiB is left "
        "for KV caches; too little for one request of the largest default size: thinker 0.56 GiB (384 "
        "blocks, got 273), talker 0.12 GiB (384 blocks, got 327). Options: on one 80 GB card, "
        "--deploy-config 80gb")
    pinned = (r"0.00 GiB is left for KV caches; the pinned \(int\) kv_cache_memory asks 1.00 GiB; too little "
              r"for one request of the largest default size: talker 0.00 GiB \(1 blocks, got 0\)\. Options")
    with pytest.raises(MemoryBudgetError, match=pinned):
        plan_kv("cuda:0", mem, 0.9, stages(GiB, 0.2), 30 * GiB)


def test_the_start_up_line():
    line = kv_summary("thinker", "cuda:0", 28000, 16, 28000 * THINKER_BLOCK, 447984, "prompt + max_tokens")
    assert line == ("thinker on cuda:0: KV cache 41.02 GiB, 28000 blocks x 16 = 448000 tokens; one request "
                    "may hold 447984 tokens (prompt + max_tokens)")


def test_the_log_names_the_capacity_the_engine_refuses_past(tiny_dir, caplog):
    from omnistage import Omni

    with caplog.at_level(logging.INFO, logger="omnistage.pipeline.placement.sizing"):
        omni = Omni(tiny_dir, deploy=load_deploy_config(resolve_deploy_config(tiny_dir, None), "cpu"),
                    device="cpu")
    try:
        lines = [r.getMessage() for r in caplog.records if " KV cache " in r.getMessage()]
        room = omni.engine.stages.thinkers[0].kv_capacity
        assert lines[0].startswith("thinker on cpu: KV cache 0.06 GiB, ")
        assert lines[0].endswith(f"one request may hold {room} tokens (prompt + max_tokens)")
        assert lines[1].startswith("talker on cpu: KV cache 0.06 GiB, ") and len(lines) == 2
        omni.engine.make_request("a", None, [1] * (room - 4), want_audio=False, voice=None,
                                 sampling={"max_tokens": 4}, talker_sampling=None, emit=lambda d: None)
        too_long = rf"= {room + 1} exceeds the thinker's KV cache \({room} tokens\)"
        with pytest.raises(ValueError, match=too_long):
            omni.engine.make_request("b", None, [1] * (room - 3), want_audio=False, voice=None,
                                     sampling={"max_tokens": 4}, talker_sampling=None, emit=lambda d: None)
    finally:
        omni.engine.shutdown()


def faked_cuda(tiny_dir, monkeypatch, make):
    """`sizing.build_sized` on a CUDA device, its allocator readings faked from what `make` built so far
    (`make.calls`: (stage, blocks)); returns (built, weights, bytes per block of each stage)."""
    from omnistage.pipeline.placement import sizing
    from omnistage.pipeline.placement.local import Placement

    deploy = load_deploy_config(DEPLOY_DIR / "qwen3_omni_moe.yaml", "cuda",
                                overrides={"gpu_memory_utilization": 0.5})
    p = Placement(load_config(tiny_dir), deploy, tiny_dir, device="cpu")
    keys = [("thinker", 0), ("talker", 0), ("code2wav", 0)]
    loaded = sizing.Loaded({k: p.build(*k) for k in keys}, {k: p.place(*k) for k in keys},
                           {torch.device("cpu"): DeviceMemory(8 * GiB, 8 * GiB)})
    weights = sum(sizing.module_bytes(m) for m in loaded.modules.values())
    per_block = {n: sizing.bytes_per_block(loaded.modules[n, 0], 16, torch.bfloat16)
                 for n in ("thinker", "talker")}

    def trial_bytes():
        return sum(b * per_block[n] for n, b in make.calls[:3] if b)

    for name, fake in {"empty_cache": lambda: None, "synchronize": lambda d=None: None,
                       "reset_peak_memory_stats": lambda d=None: None,
                       "memory_reserved": lambda d=None: weights + trial_bytes() + 100 * MiB,
                       "max_memory_reserved": lambda d=None: weights + trial_bytes() + 100 * MiB,
                       "mem_get_info": lambda d=None: (8 * GiB - weights - trial_bytes() - 110 * MiB,
                                                       8 * GiB)}.items():
        monkeypatch.setattr(torch.cuda, name, fake)
    return sizing.build_sized(p, loaded, sizing.kv_shares(p, {k: 0 for k in keys}), make), weights, per_block


def recording_make(fail_on: str | None = None):
    from omnistage.engine.block_manager import BlockManager

    def make(name, i, module, blocks):
        make.calls.append((name, blocks))
        if name == fail_on:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 422.00 MiB.")
        return SimpleNamespace(blocks=BlockManager(blocks, 16) if blocks else None)

    make.calls = []
    return make


def test_the_cuda_sizing_steps_with_the_device_memory_faked(tiny_dir, monkeypatch):
    """A profiling build with provisional caches, then the final build with the planned blocks; the
    overhead is the measured peak plus the memory outside the allocator, less the weights and the
    provisional caches, plus the thinker's encoder and prefix-row caches."""
    make = recording_make()
    built, weights, per_block = faked_cuda(tiny_dir, monkeypatch, make)
    calls = make.calls
    # provisional: the thinker's widest decode graph (512 blocks, wider than its largest request: 4096 + 2048
    # tokens, 384 blocks), the talker's largest request (4096 + 9 + 4096 rows, 513 blocks); + the padding block
    assert calls[:3] == [("thinker", 513), ("talker", 515), ("code2wav", 0)]
    rest = 4 * GiB - weights - 110 * MiB - 2 * 512 * MiB  # and the thinker's caches beside it (encoder_cache_mb)
    assert calls[3:] == [("thinker", int(rest * 0.8) // per_block["thinker"]),
                         ("talker", int(rest * 0.2) // per_block["talker"]), ("code2wav", 0)]
    assert built["thinker", 0].blocks.num_blocks == calls[3][1]


def test_out_of_memory_in_the_profiling_build_is_the_budget_message(tiny_dir, monkeypatch):
    # on the H200 with 61.5 GB held, the default config's graphs did not fit beside the weights (a traceback)
    with pytest.raises(MemoryBudgetError) as e:
        faked_cuda(tiny_dir, monkeypatch, recording_make(fail_on="talker"))
    message = str(e.value)
    assert message.startswith("cpu: out of memory while capturing the CUDA graphs with small KV caches (")
    assert ("4.00 GiB may be used (0.50 x 8.00 GiB total - 0.00 GiB held by other processes), 8.00 GiB was "
            "free at start. Options: on one 80 GB card, --deploy-config 80gb") in message


def test_serve_exits_with_the_budget_message_not_a_traceback(tiny_dir, monkeypatch):
    from omnistage.entrypoints import async_omni
    from omnistage.server.launch import LaunchError, build

    def refuse(*args, **kwargs):
        raise MemoryBudgetError("cuda:0: the weights need 65.68 GiB (...)")

    monkeypatch.setattr(async_omni, "AsyncOmni", refuse)
    args = add_serve_args(argparse.ArgumentParser()).parse_args([str(tiny_dir), "--device", "cpu"])
    with pytest.raises(LaunchError) as e:
        build(args)
    assert str(e.value) == "omnistage serve: cuda:0: the weights need 65.68 GiB (...)"
