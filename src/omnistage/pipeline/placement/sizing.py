"""KV caches sized to the device (`memory.py` does the arithmetic): load every module placed on a device,
measure what the stages need besides their KV caches, then build the stages with the rest.

On CUDA, per device: (1) the free memory before anything is placed there; (2) the weights' bytes, counted on
the meta device, checked against the budget before loading (a clear refusal, not an out-of-memory error
half-way through the load); (3) every module loaded; (4) a profiling build: each stage with a provisional
cache just large enough for the shapes it captures, its CUDA graphs captured; the overhead is the
allocator's peak plus the memory taken outside it, less the weights and the provisional caches; then the
stages dropped; (5) `memory.plan_kv`; (6) the stages built again with their planned caches and captured
again. NOTE: (4) doubles the capture time
at start; it measures the graph pools exactly instead of guessing them. Lazy captures at run time (widths
not captured at start) and eager prefills of multimodal prompts come out of the 1 - utilization headroom.
Elsewhere (the CPU) a stage's cache is its `kv_cache_memory`: bytes, or a fraction of a nominal 8 GiB.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from itertools import chain
from typing import Any

import torch

from omnistage.config import StageConfig
from omnistage.layers.attention import Attention
from omnistage.models.qwen3_omni.model import quantize_stage, stage_module
from omnistage.models.qwen3_omni.talker_prompt_rows import ASSISTANT_ROWS
from omnistage.pipeline.placement.memory import (DeviceMemory, MemoryBudgetError, StageMemory, budget,
                                                 check_weights, gib, kv_summary, min_blocks, plan_kv,
                                                 profiling_oom, relative_shares)
from omnistage.pipeline.placement.stage_handle import worker_name
from omnistage.sampling_params import SamplingParams, TalkerSamplingParams, from_dict

logger = logging.getLogger(__name__)

Key = tuple[str, int]  # (stage, replica)
MakeStage = Callable[[str, int, torch.nn.Module, int], Any]  # a stage built (and captured) with its KV blocks
NOMINAL_CPU_MEMORY = 8 << 30
TALKER_PROMPT_ROWS = ASSISTANT_ROWS  # a talker prompt's rows besides the user's turns (orchestrator's check)


def device_memory(device: torch.device) -> DeviceMemory | None:
    """The device's memory now; None where it has no budget (the CPU)."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return DeviceMemory(total, free)


def weight_bytes(config: Any, name: str, dtype: torch.dtype, quantization: str | None = None) -> int:
    """A stage's parameters and buffers in `dtype` (FP8 ones and their scales as `quantization` leaves them),
    counted on the meta device (nothing allocated)."""
    with torch.device("meta"):
        return module_bytes(quantize_stage(stage_module(config, name).to(dtype), quantization))


def module_bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in chain(module.parameters(), module.buffers()))


def bytes_per_block(module: torch.nn.Module, block_size: int, dtype: torch.dtype) -> int:
    cfg = module.model.config
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim
    return per_token * block_size * torch.tensor([], dtype=dtype).element_size()


def fixed_blocks(sc: StageConfig, per_block: int) -> int:
    """Blocks off the device budget: bytes (int) or a fraction of a nominal 8 GiB (float), at least 8."""
    budget = sc.kv_cache_memory
    return max(8, (budget if isinstance(budget, int) else int(NOMINAL_CPU_MEMORY * budget)) // per_block)


def largest_request(deploy: Any, name: str) -> int:
    """KV tokens of one request of the largest default size: a full prefill step's prompt plus the deploy
    config's default max_tokens (thinker) or its talker prompt plus max_frames (talker)."""
    prompt = deploy.stage("thinker").max_num_batched_tokens
    if name == "thinker":
        return prompt + from_dict(SamplingParams, deploy.stage("thinker").sampling).max_tokens
    frames = from_dict(TalkerSamplingParams, deploy.stage("talker").sampling).max_frames
    return prompt + TALKER_PROMPT_ROWS + frames


def provisional_blocks(sc: StageConfig, minimum: int) -> int:
    """Blocks for the profiling build: every captured shape fits (widths, prefill buckets), one padding."""
    widths = max(sc.cuda_graph_capture_widths, default=0)
    prefill = -(-max(sc.cuda_graph_prefill_tokens, default=0) // sc.block_size)
    return max(minimum, widths, prefill) + 1


def stage_memory(p: Any, key: Key, module: torch.nn.Module, dtype: torch.dtype, share: float | int
                 ) -> StageMemory:
    name, sc = key[0], p.deploy.stage(key[0])
    if name == "code2wav":
        return StageMemory(label(p, key), module_bytes(module))
    per_block = bytes_per_block(module, sc.block_size, dtype)
    need = min_blocks(largest_request(p.deploy, name), sc.block_size, reserved=int(sc.cuda_graph))
    return StageMemory(label(p, key), module_bytes(module), share, per_block, need)


@dataclass
class Loaded:
    """The modules of some stage replicas, loaded; `memory`: each CUDA device's memory before loading."""

    modules: dict[Key, torch.nn.Module]
    places: dict[Key, tuple[torch.device, torch.dtype]]
    memory: dict[torch.device, DeviceMemory]


def load_modules(p: Any, keys: list[Key]) -> Loaded:
    """Each replica's module on its device, once the weights of every CUDA device passed `check_weights`;
    each quantised (deploy `quantization`) as soon as it is loaded.
    NOTE: FP8 experts are quantised as they load (the peak: one tensor in the stage's dtype); `fp8-all`'s dense
    projections are loaded in the dtype first."""
    places = {k: p.place(*k) for k in keys}
    devices = list(dict.fromkeys(d for d, _ in places.values()))
    memory = {d: m for d in devices if (m := device_memory(d)) is not None}
    for d, mem in memory.items():
        stages = [StageMemory(label(p, k), weight_bytes(p.config, k[0], dt, p.deploy.stage(k[0]).quantization))
                  for k, (dev, dt) in places.items() if dev == d]
        check_weights(str(d), mem, p.deploy.gpu_memory_utilization, stages)
    modules = {k: quantize_stage(p.build(*k), p.deploy.stage(k[0]).quantization) for k in keys}
    return Loaded(modules, places, memory)


def label(p: Any, key: Key) -> str:
    return worker_name(key[0], key[1], p.deploy.stage(key[0]).replicas)


def kv_shares(p: Any, groups: dict[Key, Hashable]) -> dict[Key, float | int]:
    """Each replica's `kv_cache_memory` relative to the others' in its group (its device)
    (`memory.relative_shares`)."""
    out: dict[Key, float | int] = {}
    for g in dict.fromkeys(groups.values()):
        keys = [k for k in groups if groups[k] == g and k[0] != "code2wav"]
        out |= relative_shares({k: p.deploy.stage(k[0]).kv_cache_memory for k in keys})
    return out


def build_sized(p: Any, loaded: Loaded, shares: dict[Key, float | int], make: MakeStage) -> dict[Key, Any]:
    """Every stage of `loaded` built by `make` with its KV blocks; `shares` as `kv_shares` gives them."""
    blocks: dict[Key, int] = {}
    for device in dict.fromkeys(d for d, _ in loaded.places.values()):
        keys = [k for k, (d, _) in loaded.places.items() if d == device]
        stages = {k: stage_memory(p, k, loaded.modules[k], loaded.places[k][1], shares.get(k, 0.0))
                  for k in keys}
        if device in loaded.memory:
            blocks |= _plan_device(p, device, loaded.memory[device], stages, loaded.modules, make)
        else:
            blocks |= {k: fixed_blocks(p.deploy.stage(k[0]), s.bytes_per_block) for k, s in stages.items()
                       if s.bytes_per_block}
    built = {k: make(k[0], k[1], loaded.modules[k], blocks.get(k, 0)) for k in loaded.modules}
    for k, stage in built.items():
        _log(p, k, loaded.places[k], loaded.modules[k], stage)
    return built


def _plan_device(p: Any, device: torch.device, mem: DeviceMemory, stages: dict[Key, StageMemory],
                 modules: dict[Key, torch.nn.Module], make: MakeStage) -> dict[Key, int]:
    """Profiling build, then `plan_kv` (see the module docstring)."""
    util = p.deploy.gpu_memory_utilization
    _release(device)
    torch.cuda.reset_peak_memory_stats(device)
    trial = {k: provisional_blocks(p.deploy.stage(k[0]), s.min_blocks) for k, s in stages.items()
             if s.bytes_per_block}
    try:
        built = [make(k[0], k[1], modules[k], trial.get(k, 0)) for k in stages]
    except torch.OutOfMemoryError:
        _drop_kv_caches([modules[k] for k in stages])
        _release(device)
        provisional = sum(n * stages[k].bytes_per_block for k, n in trial.items())
        raise MemoryBudgetError(profiling_oom(str(device), mem, util, stages.values(), provisional)) from None
    torch.cuda.synchronize(device)
    peak, now = torch.cuda.max_memory_reserved(device), torch.cuda.memory_reserved(device)
    # NOTE: what this process took outside torch's allocator since `mem` (cuBLAS workspaces, kernel images)
    outside = max(0, mem.free - torch.cuda.mem_get_info(device)[0] - now)
    del built
    _drop_kv_caches([modules[k] for k in stages])
    _release(device)
    provisional = sum(n * stages[k].bytes_per_block for k, n in trial.items())
    overhead = peak + outside - provisional - sum(s.weight_bytes for s in stages.values())
    overhead += 2 * (p.deploy.encoder_cache_mb << 20) * sum(k[0] == "thinker" for k in stages)  # see ThinkerStage
    plans = {plan.name: plan for plan in plan_kv(str(device), mem, util, list(stages.values()), overhead)}
    logger.info("%s: budget %s (gpu_memory_utilization %.2f x %s - %s held by others); weights %s; CUDA "
                "graphs, buffers and activations %s (measured)", device, gib(budget(mem, util)), util,
                gib(mem.total), gib(mem.held_by_others), gib(sum(s.weight_bytes for s in stages.values())),
                gib(overhead))
    return {k: plans[s.name].num_blocks for k, s in stages.items() if s.bytes_per_block}


def _drop_kv_caches(modules: list[torch.nn.Module]) -> None:
    """The profiling build's caches, before the final ones are allocated (not both at once)."""
    for m in chain.from_iterable(module.modules() for module in modules):
        if isinstance(m, Attention):
            m.k_cache = m.v_cache = None


def _release(device: torch.device) -> None:
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()


def _log(p: Any, key: Key, place: tuple[torch.device, torch.dtype], module: torch.nn.Module,
         stage: Any) -> None:
    blocks = getattr(stage, "blocks", None)
    if blocks is None:
        return
    sc = p.deploy.stage(key[0])
    total = blocks.num_blocks + int(sc.cuda_graph)
    per_block = bytes_per_block(module, sc.block_size, place[1])
    bound = "prompt + max_tokens" if key[0] == "thinker" else f"prompt + {TALKER_PROMPT_ROWS} + max_frames"
    logger.info(kv_summary(label(p, key), str(place[0]), total, sc.block_size, total * per_block,
                           blocks.capacity, bound))
