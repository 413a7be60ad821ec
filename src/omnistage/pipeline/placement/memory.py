"""The memory budget of one device, as vLLM's `--gpu-memory-utilization`: pure arithmetic (device memory as
parameters), so that the splits and the refusals are tested without a GPU.

Rule: this process may use `gpu_memory_utilization x total` of the card, less what other processes held
when it started (`total - free` before it placed anything there; as vLLM v0 counted it: vLLM v1 instead
refuses when less than `utilization x total` is free). Out of that budget come, in order, the weights of
every stage on the device, the measured overhead (CUDA-graph pools, static buffers, the capture warm-ups'
peak, memory outside torch's allocator), the KV caches pinned in bytes (int `kv_cache_memory`), and the
rest is split over the stages' float `kv_cache_memory`, as relative shares (`relative_shares`: f / the sum of
the floats of the stages on that device).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

GiB = 1 << 30
ONE_80GB_LAYOUT = "80gb"  # the packaged deploy config for one 80 GB card
TWO_GPU_LAYOUT = "2x80gb"  # the packaged deploy config (`--deploy-config 2x80gb`) that splits the stages


class MemoryBudgetError(RuntimeError):
    """The stages do not fit the device's budget; the message names the bytes and the options."""


@dataclass(frozen=True)
class DeviceMemory:
    """`free`: before this process placed anything on the device (other processes' memory is the rest)."""

    total: int
    free: int

    @property
    def held_by_others(self) -> int:
        return self.total - self.free


@dataclass(frozen=True)
class StageMemory:
    """One stage replica on the device. `bytes_per_block` 0: no paged KV cache (code2wav);
    `min_blocks`: the fewest KV blocks it may start with (one request of the largest default size)."""

    name: str
    weight_bytes: int
    kv_cache_memory: float | int = 0.0
    bytes_per_block: int = 0
    min_blocks: int = 0


@dataclass(frozen=True)
class KVPlan:
    name: str
    num_blocks: int
    kv_bytes: int


def gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


def budget(mem: DeviceMemory, utilization: float) -> int:
    """Bytes this process may use on the device."""
    return int(utilization * mem.total) - mem.held_by_others


def _budget_text(mem: DeviceMemory, utilization: float) -> str:
    return (f"{gib(max(budget(mem, utilization), 0))} may be used ({utilization:.2f} x {gib(mem.total)} "
            f"total - {gib(mem.held_by_others)} held by other processes)")


def options(utilization: float) -> str:
    return (f"Options: on one 80 GB card, --deploy-config {ONE_80GB_LAYOUT} (smaller CUDA-graph sets, "
            f"batches and caches); spread the stages over more GPUs (--deploy-config {TWO_GPU_LAYOUT}: the "
            "thinker on GPU 0, the talker and code2wav on GPU 1); raise --gpu-memory-utilization (now "
            f"{utilization:.2f}) if nothing else needs the card; free the memory other processes hold; "
            "smaller KV caches (kv_cache_memory in bytes), CUDA-graph sets and max_batch_size in the deploy "
            "config; FP8 weights for the thinker and talker (--quantization fp8).")


def check_weights(device: str, mem: DeviceMemory, utilization: float, stages: list[StageMemory]) -> None:
    """Before loading: refuse when the weights alone exceed the budget."""
    need = sum(s.weight_bytes for s in stages)
    if need > budget(mem, utilization):
        each = ", ".join(f"{s.name} {gib(s.weight_bytes)}" for s in stages)
        raise MemoryBudgetError(f"{device}: the weights need {gib(need)} ({each}) but "
                                f"{_budget_text(mem, utilization)}. {options(utilization)}")


def profiling_oom(device: str, mem: DeviceMemory, utilization: float, stages: Iterable[StageMemory],
                  provisional_kv: int) -> str:
    """The refusal when the profiling build (small KV caches, CUDA graphs captured) ran out of memory."""
    weights = sum(s.weight_bytes for s in stages)
    return (f"{device}: out of memory while capturing the CUDA graphs with small KV caches "
            f"({gib(provisional_kv)}) after the weights ({gib(weights)}): {_budget_text(mem, utilization)}, "
            f"{gib(mem.free)} was free at start. {options(utilization)}")


def relative_shares(memory: dict[Hashable, float | int]) -> dict[Hashable, float | int]:
    """Float `kv_cache_memory` values as fractions of their sum (relative shares); ints (bytes) as given."""
    floats = sum(v for v in memory.values() if isinstance(v, float))
    return {k: v / floats if isinstance(v, float) else v for k, v in memory.items()}


def plan_kv(device: str, mem: DeviceMemory, utilization: float, stages: list[StageMemory],
            overhead_bytes: int) -> list[KVPlan]:
    """KV blocks of each stage with a paged cache on the device, or MemoryBudgetError. A float
    `kv_cache_memory` is the stage's fraction of what is left (see `relative_shares`; more than 1 in all is
    scaled down to 1)."""
    weights = sum(s.weight_bytes for s in stages)
    paged = [s for s in stages if s.bytes_per_block]
    pinned = {s.name: int(s.kv_cache_memory) for s in paged if isinstance(s.kv_cache_memory, int)}
    shares = {s.name: float(s.kv_cache_memory) for s in paged if s.name not in pinned}
    left = budget(mem, utilization) - weights - overhead_bytes
    rest = left - sum(pinned.values())
    plans = []
    for s in paged:
        kv = pinned.get(s.name)
        if kv is None:
            kv = int(max(rest, 0) * shares[s.name] / max(1.0, sum(shares.values())))
        plans.append(KVPlan(s.name, kv // s.bytes_per_block, kv // s.bytes_per_block * s.bytes_per_block))
    short = [(s, p) for s, p in zip(paged, plans) if p.num_blocks < max(s.min_blocks, 1)]
    if rest < 0 or short:
        need = ", ".join(f"{s.name} {gib(s.min_blocks * s.bytes_per_block)} ({s.min_blocks} blocks, got "
                         f"{p.num_blocks})" for s, p in short)
        raise MemoryBudgetError(
            f"{device}: {_budget_text(mem, utilization)}; after the weights ({gib(weights)}) and the CUDA "
            f"graphs, buffers and activations ({gib(overhead_bytes)}) {gib(max(left, 0))} is left for KV "
            "caches"
            + (f"; the pinned (int) kv_cache_memory asks {gib(sum(pinned.values()))}" if pinned else "")
            + (f"; too little for one request of the largest default size: {need}" if short else "")
            + f". {options(utilization)}")
    return plans


def min_blocks(tokens: int, block_size: int, reserved: int = 0) -> int:
    """Blocks that hold one request of `tokens` tokens, plus `reserved` (a CUDA graph's padding block)."""
    return math.ceil(tokens / block_size) + reserved


def kv_summary(name: str, device: str, num_blocks: int, block_size: int, kv_bytes: int, capacity: int,
               bound: str) -> str:
    """The start-up log line of a stage's KV cache; `capacity` is what one request may hold (the
    engine refuses more with a 400), `bound` how a request's size counts against it."""
    return (f"{name} on {device}: KV cache {gib(kv_bytes)}, {num_blocks} blocks x {block_size} = "
            f"{num_blocks * block_size} tokens; one request may hold {capacity} tokens ({bound})")
