"""safetensors checkpoints in HF's layout: `model.safetensors`, or shards + `model.safetensors.index.json`."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def shard_name(index: int, count: int) -> str:
    return SINGLE_FILE if count == 1 else f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def plan_shards(sizes: Sequence[int], max_shard_bytes: int) -> list[list[int]]:
    """Consecutive groups of item indices, at most `max_shard_bytes` each (a larger item stands alone)."""
    groups: list[list[int]] = []
    used = max_shard_bytes
    for i, size in enumerate(sizes):
        if used + size > max_shard_bytes:
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += size
    return groups


def write_checkpoint(out_dir: Path, shards: Sequence[Callable[[], dict[str, torch.Tensor]]]) -> list[Path]:
    """Write each shard's tensors (made on demand, one shard in memory at a time); deterministic bytes."""
    from safetensors.torch import save_file

    weight_map: dict[str, str] = {}
    total = 0
    paths = []
    for i, make in enumerate(shards):
        name = shard_name(i, len(shards))
        tensors = make()
        save_file(tensors, str(out_dir / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        paths.append(out_dir / name)
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return paths


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a model folder, from its index when there is one."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.exists():
        return [model_dir / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    if (model_dir / SINGLE_FILE).exists():
        return [model_dir / SINGLE_FILE]
    raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {model_dir}")
