"""Load one stage's weights from a safetensors checkpoint directory, or make seeded dummy weights.

Our parameter names are the real checkpoint's names with the stage prefix stripped, except that
MoE experts are held fused per layer (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]).
The checkpoint may hold per-expert tensors (the real layout) or fused ones, and module paths of
other transformers versions (`thinker.model.language_model.*`, `thinker.model.audio_tower.*`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from omnistage.layers import fp8
from omnistage.models.qwen3_omni.checkpoint_names import expert_slot, hf_to_checkpoint_name
from omnistage.models.qwen3_omni.fp8_checkpoint import dequantized, weight_block
from omnistage.models.qwen3_omni.random_init import random_tensor


def checkpoint_files(model_dir: str | Path, prefix: str = "") -> list[Path]:
    """The safetensors files that hold tensors under `prefix` (all files when there is no index)."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        names = sorted({f for k, f in weight_map.items() if hf_to_checkpoint_name(k).startswith(prefix)})
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    return files


def iter_checkpoint(model_dir: str | Path, prefix: str, device: str | torch.device = "cpu"
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """(canonical name, tensor) for every tensor whose canonical name starts with `prefix`."""
    for path in checkpoint_files(model_dir, prefix):
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            for key in f.keys():
                name = hf_to_checkpoint_name(key)
                if name.startswith(prefix):
                    yield name, f.get_tensor(key)


@torch.no_grad()
def load_stage_weights(module: nn.Module, model_dir: str | Path, stage: str) -> None:
    """Copy the stage's checkpoint tensors into `module` (already on its device and dtype), FP8 weights
    dequantised by their scales (fp8_checkpoint.py); experts made in FP8 (`moe.experts_on_meta`) get each tensor
    in the stage's dtype quantised per row. Every parameter and persistent buffer must be covered; extra
    checkpoint tensors are an error."""
    targets = dict(module.state_dict(keep_vars=True))
    seen: set[str] = set()
    device, dtype = next(iter(targets.values())).device, stage_dtype(module)
    for name, tensor in dequantized(iter_checkpoint(model_dir, stage + ".", device="cpu"), weight_block(model_dir)):
        local = name[len(stage) + 1:]
        target, key = _target(targets, local)
        if target is None:
            raise KeyError(f"checkpoint tensor {name} has no place in our {stage} module")
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != ours {tuple(target.shape)}")
        if target.dtype == fp8.FP8:
            q, scale = fp8.quantize_rows(tensor.to(device=device, dtype=dtype))
            target.copy_(q)
            _scale_of(targets, local).copy_(scale)
        else:
            target.copy_(tensor.to(device=device, dtype=target.dtype))
        seen.add(key)
    missing = [k for k in _expected_keys(targets, seen) if k not in seen]
    if missing:
        raise KeyError(f"{stage}: {len(missing)} tensors missing from the checkpoint, e.g. {missing[:5]}")


def _target(targets: dict[str, torch.Tensor], local: str) -> tuple[torch.Tensor | None, str]:
    slot = expert_slot(local)
    if slot is None:
        return targets.get(local), local
    fused = targets.get(slot.fused_name)
    base = slot.fused_name.rpartition(".")[0]
    return (None if fused is None else slot.view(fused)), f"{base}.{slot.expert}.{slot.part}"


def _scale_of(targets: dict[str, torch.Tensor], local: str) -> torch.Tensor:
    """The FP8 experts' row scales that go with `local` (a per-expert slice or a fused tensor)."""
    slot = expert_slot(local)
    name = local if slot is None else slot.fused_name
    scale = targets[name.replace("_proj", "_scale")]
    return scale if slot is None else slot.view(scale)


def stage_dtype(module: nn.Module) -> torch.dtype:
    """The dtype the stage computes in: its first parameter's that is not FP8."""
    return next(p.dtype for p in module.parameters() if p.dtype != fp8.FP8)


def _expected_keys(targets: dict[str, torch.Tensor], seen: set[str]) -> Iterator[str]:
    """Names a checkpoint must provide; a fused expert tensor is satisfied by itself or by all its slices."""
    for name, t in targets.items():
        if name in seen:
            yield name
        elif name.endswith((".experts.gate_up_scale", ".experts.down_scale")):
            continue  # FP8 experts' scales: made from the weights
        elif name.endswith(".experts.gate_up_proj"):
            base = name[: -len(".gate_up_proj")]
            yield from (f"{base}.{e}.{p}" for e in range(t.shape[0]) for p in ("gate", "up"))
        elif name.endswith(".experts.down_proj"):
            base = name[: -len(".down_proj")]
            yield from (f"{base}.{e}.down" for e in range(t.shape[0]))
        else:
            yield name


@torch.no_grad()
def init_dummy_weights(module: nn.Module, stage: str, seed: int = 0) -> None:
    """Seeded random weights for every parameter, made on the module's device. Seeds are keyed by the
    checkpoint name (fused experts keep their fused name), so on the same device they equal
    `make-tiny`'s tensors and `init_reference_weights`' for any transformers version. Experts made in FP8
    (`moe.experts_on_meta`) get the stage dtype's values quantised per row, one layer's tensor at a time."""
    dtype = stage_dtype(module)
    for name, p in module.named_parameters():
        values = random_tensor(f"{stage}.{name}", tuple(p.shape), seed, dtype if p.dtype == fp8.FP8 else p.dtype,
                               p.device)
        if p.dtype == fp8.FP8:
            owner, _, leaf = name.rpartition(".")
            module.get_submodule(owner).fill_fp8(leaf, values)
        else:
            p.copy_(values)


@torch.no_grad()
def init_reference_weights(model: nn.Module, seed: int = 0) -> None:
    """The same seeded values for transformers' `Qwen3OmniMoeForConditionalGeneration` (whatever its
    in-memory names), routers and experts included."""
    for name, p in model.named_parameters():
        p.copy_(random_tensor(hf_to_checkpoint_name(name), tuple(p.shape), seed, p.dtype, p.device))
