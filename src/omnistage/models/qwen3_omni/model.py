"""Build one stage of Qwen3-Omni (thinker, talker or code2wav) on a device, with real or dummy weights."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn
from transformers import Qwen3OmniMoeConfig

from omnistage.config_rules import QUANTIZATIONS
from omnistage.layers import triton_ops
from omnistage.layers.moe import FusedExperts, experts_on_meta
from omnistage.models.qwen3_omni.decoder import fuse_projections, quantize_fp8
from omnistage.models.qwen3_omni.weights import init_dummy_weights, load_stage_weights

FULL_SIZE_CONFIG = Path(__file__).parent / "configs" / "qwen3_omni_30b_a3b_instruct.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_config(model_dir: str | Path) -> Qwen3OmniMoeConfig:
    return Qwen3OmniMoeConfig.from_pretrained(str(model_dir))


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """bf16 on accelerators, fp32 on the CPU, unless asked otherwise."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return DTYPES[dtype]


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def stage_module(config: Qwen3OmniMoeConfig, stage: str) -> nn.Module:
    """The bare module of a stage (weights uninitialised), built on the current default device."""
    if stage == "thinker":
        from omnistage.models.qwen3_omni.thinker import Thinker

        return Thinker(config.thinker_config)
    if stage == "talker":
        from omnistage.models.qwen3_omni.talker import Talker

        return Talker(config.talker_config)
    if stage == "code2wav":
        from omnistage.models.qwen3_omni.code2wav import Code2Wav

        return Code2Wav(config.code2wav_config)
    raise ValueError(f"unknown stage {stage!r}")


def quantize_stage(module: nn.Module, quantization: str | None) -> nn.Module:
    """A loaded stage's weights as the deploy key `quantization` asks: None as they are, "fp8" the routed experts
    in FP8, "fp8-all" the decoders' projections too (`decoder.quantize_fp8`; thinker and talker only,
    `config_loader` checks)."""
    if quantization in QUANTIZATIONS:
        quantize_fp8(module, dense=quantization == "fp8-all")
    elif quantization is not None:
        raise ValueError(f"unknown quantization {quantization!r}")
    return module


def build_stage(config: Qwen3OmniMoeConfig, stage: str, *, model_dir: str | Path | None = None,
                load_format: str = "auto", device: str | torch.device = "cpu",
                dtype: str | torch.dtype | None = None, seed: int = 0, quantization: str | None = None
                ) -> nn.Module:
    """A stage on `device` in `dtype`, eval mode: weights from `model_dir` (load_format "auto") or
    seeded random weights made on the device itself (load_format "dummy"). On CUDA (the fast path, unless
    OMNISTAGE_FUSED_OPS=0) the decoders' projections are then merged (`decoder.fuse_projections`), and then
    quantised as `quantize_stage` does; FP8 experts are made in FP8 and quantised as they load (the same values)."""
    device = torch.device(device)
    dtype = resolve_dtype(dtype, device)
    streamed = quantization in QUANTIZATIONS  # the experts quantised as they load (`moe.experts_on_meta`)
    with torch.device(device), _default_dtype(dtype), experts_on_meta() if streamed else contextlib.nullcontext():
        module = stage_module(config, stage)
    module.to(dtype).eval().requires_grad_(False)
    for m in module.modules() if streamed else ():
        if isinstance(m, FusedExperts):
            m.empty_fp8(device)
    if load_format == "dummy":
        init_dummy_weights(module, stage, seed)
    elif load_format == "auto":
        if model_dir is None:
            raise ValueError("load_format 'auto' needs a model directory")
        load_stage_weights(module, model_dir, stage)
    else:
        raise ValueError(f"unknown load_format {load_format!r}; use 'auto' or 'dummy'")
    if device.type == "cuda" and triton_ops.ENABLED:
        fuse_projections(module)
    return quantize_stage(module, quantization)
