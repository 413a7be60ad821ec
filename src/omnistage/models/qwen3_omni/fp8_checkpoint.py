"""FP8 checkpoints as they are published, read as the stage's dtype (`dequantized`).

Two layouts: block-wise E4M3 with `weight_scale_inv` `[ceil(out / bo), ceil(in / bi)]` beside each quantised
weight, the block `quantization_config.weight_block_size` (Qwen's FP8 releases, marksverdhei/Qwen3-Omni-30B-A3B-FP8:
the thinker's and talker's linears and experts; encoders, code2wav, embeddings, norms and routers stay bf16);
and E4M3 with `weight_scale` per tensor or per output channel (llm-compressor's `compressed-tensors`; its
`input_scale` of static activation scales is not used: activations stay in the stage's dtype). In both a weight
is `fp8 value x its block's (channel's) scale`. Here they are dequantised when loaded, and a checkpoint published
in FP8 is held in FP8 (`with_checkpoint_quantization`: `quantization: fp8-all` where the deploy config names
none), each weight quantised again per output row as it loads (`decoder.quantize_fp8`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import torch

from omnistage.config import DeployConfig
from omnistage.config_rules import QUANTIZED_STAGES

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
SCALES = (".weight_scale_inv", ".weight_scale", ".input_scale")
logger = logging.getLogger(__name__)


def weight_block(model_dir: str | Path) -> tuple[int, int] | None:
    """The checkpoint's `quantization_config.weight_block_size` (None: no blocks)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    block = (config.get("quantization_config") or {}).get("weight_block_size")
    return None if block is None else (int(block[0]), int(block[1]))


def published_fp8(model_dir: str | Path) -> bool:
    """Whether config.json's `quantization_config` says FP8 weights: `quant_method` fp8 (Qwen's releases),
    compressed-tensors with 8-bit float weights, or ModelOpt's FP8."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    q = config.get("quantization_config") or {}
    method = str(q.get("quant_method", "")).lower()
    if method == "compressed-tensors":
        groups = (q.get("config_groups") or {}).values()
        return any((g.get("weights") or {}).get("type") == "float" and (g.get("weights") or {}).get("num_bits") == 8
                   for g in groups)
    return method == "fp8" or (method == "modelopt" and "FP8" in str(q.get("quant_algo", "")).upper())


def with_checkpoint_quantization(deploy: DeployConfig, model_dir: str | Path) -> DeployConfig:
    """`deploy` with the thinker and talker held in FP8 (`fp8-all`: the projections the published checkpoints
    quantise) where they name no `quantization`, when the checkpoint is published in FP8; else as it is."""
    if not published_fp8(model_dir):
        return deploy
    stages = deploy.stages
    for name in QUANTIZED_STAGES:
        stage = getattr(stages, name)
        if stage.quantization is None:
            stages = replace(stages, **{name: replace(stage, quantization="fp8-all")})
            logger.info("%s: the checkpoint is in FP8: held in FP8 (quantization fp8-all)", name)
    return replace(deploy, stages=stages)


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """An FP8 weight `[out, in]` and its scale (`[ceil(out / bo), ceil(in / bi)]` blocks, `[out]` / `[out, 1]`
    channels, or one) -> float32 values."""
    w, s = weight.to(torch.float32), scale.to(torch.float32)
    if s.numel() == 1:
        return w * s.reshape(())
    if s.numel() == w.shape[0]:
        return w * s.reshape(-1, 1)
    if block is None or s.dim() != 2:
        raise ValueError(f"an FP8 weight {tuple(w.shape)} with scales {tuple(s.shape)} needs the checkpoint's "
                         "quantization_config.weight_block_size")
    bo, bi = block
    if tuple(s.shape) != (-(-w.shape[0] // bo), -(-w.shape[1] // bi)):
        raise ValueError(f"block scales {tuple(s.shape)} do not tile a weight {tuple(w.shape)} in {block} blocks")
    full = s.repeat_interleave(bo, 0)[: w.shape[0]].repeat_interleave(bi, 1)[:, : w.shape[1]]
    return w * full


def dequantized(tensors: Iterator[tuple[str, torch.Tensor]], block: tuple[int, int] | None
                ) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's (name, tensor)s with every FP8 weight dequantised by its scale (the scales themselves
    consumed); tensors of other dtypes as they are. An FP8 weight without a scale, or a scale without its
    weight, is an error (read as plain numbers they would be silently wrong)."""
    weights: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    for name, t in tensors:
        suffix = next((s for s in SCALES if name.endswith(s)), None)
        if suffix == ".input_scale":
            continue
        if suffix is not None:
            base = name[: -len(suffix)] + ".weight"
            scales[base] = t
        elif t.dtype in FP8:
            base = name
            weights[base] = t
        else:
            yield name, t
            continue
        if base in weights and base in scales:
            yield base, dequantize(weights.pop(base), scales.pop(base), block)
    if weights or scales:
        raise KeyError(f"FP8 weights without their scales or scales without their weights, e.g. "
                       f"{sorted([*weights, *scales])[:3]}")
