"""Tensor names of Qwen3-Omni: HF in-memory (transformers 5.x) <-> real checkpoint (safetensors on disk).

HF keeps the thinker's text model under `thinker.model.language_model.*`, its encoders under
`thinker.model.{audio_tower,visual}.*` and each MoE layer's experts fused (`mlp.experts.gate_up_proj`
[E, 2I, H], gate rows first, and `mlp.experts.down_proj` [E, H, I]). The checkpoint has
`thinker.model.*`, `thinker.{audio_tower,visual}.*` and one `mlp.experts.{e}.{gate,up,down}_proj.weight`
per expert. Our module names are the checkpoint names without the stage prefix, experts fused like HF.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch

STAGES = ("thinker", "talker", "code2wav")
# (HF in-memory prefix, checkpoint prefix)
_PREFIXES = (
    ("thinker.model.language_model.", "thinker.model."),
    ("thinker.model.audio_tower.", "thinker.audio_tower."),
    ("thinker.model.visual.", "thinker.visual."),
)
_EXPERT = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<expert>\d+)\.(?P<part>gate|up|down)_proj\.weight$")
FUSED_EXPERT_LEAVES = ("gate_up_proj", "down_proj")


@dataclass(frozen=True)
class ExpertSlot:
    """Where one per-expert checkpoint tensor lives inside a fused expert tensor."""

    fused_name: str  # e.g. "talker.model.layers.0.mlp.experts.gate_up_proj" (same naming as its source)
    expert: int
    part: str  # "gate" | "up" | "down"

    def view(self, fused: torch.Tensor) -> torch.Tensor:
        """The slice of `fused` ([E, 2I, H] or [E, H, I]) that holds this tensor; copy into it to load."""
        rows = fused[self.expert]
        if self.part == "down":
            return rows
        half = rows.shape[0] // 2
        return rows[:half] if self.part == "gate" else rows[half:]


def hf_to_checkpoint_name(name: str) -> str:
    """HF in-memory name -> checkpoint name (fused expert names keep their leaf; see `checkpoint_tensors`)."""
    for hf, ckpt in _PREFIXES:
        if name.startswith(hf):
            return ckpt + name[len(hf):]
    return name


def checkpoint_to_hf_name(name: str) -> str:
    """Checkpoint name -> HF in-memory name in transformers 5.24's layout (5.17 keeps checkpoint names in
    memory); a per-expert name maps to its fused tensor's name."""
    slot = expert_slot(name)
    if slot is not None:
        name = slot.fused_name
    for hf, ckpt in _PREFIXES:
        if name.startswith(ckpt):
            return hf + name[len(ckpt):]
    return name


def expert_slot(name: str) -> ExpertSlot | None:
    """Fused tensor (named like `name`) and slice of a per-expert checkpoint tensor; None for other names."""
    match = _EXPERT.match(name)
    if match is None:
        return None
    leaf = "down_proj" if match["part"] == "down" else "gate_up_proj"
    return ExpertSlot(f"{match['prefix']}.{leaf}", int(match["expert"]), match["part"])


def split_stage(name: str) -> tuple[str, str]:
    """Checkpoint name -> (stage, our module name), e.g. ("thinker", "model.norm.weight")."""
    stage, _, rest = name.partition(".")
    if stage not in STAGES:
        raise ValueError(f"tensor {name!r} belongs to no stage {STAGES}")
    return stage, rest


def checkpoint_tensors(hf_name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint tensors holding one HF in-memory tensor (one, or 2E / E per-expert slices)."""
    name = hf_to_checkpoint_name(hf_name)
    prefix, _, leaf = name.rpartition(".")
    if not prefix.endswith(".mlp.experts") or leaf not in FUSED_EXPERT_LEAVES:
        yield name, tensor
        return
    parts = ("down",) if leaf == "down_proj" else ("gate", "up")
    for e in range(tensor.shape[0]):
        for part in parts:
            slot = ExpertSlot(name, e, part)
            yield f"{prefix}.{e}.{part}_proj.weight", slot.view(tensor)
