"""`omnistage make-tiny`: a complete HF-format Qwen3-Omni folder with seeded random weights.

Every tensor is `random_tensor(<checkpoint name, experts fused>, shape, seed)` (fused experts: per-expert slices of
the fused tensor), so the folder loaded by transformers holds the same weights as the test fixture
`hf_reference(preset, seed)`. Names and shapes come from transformers' model built on the meta device,
written under the real checkpoint's names (`checkpoint_names`), fp32.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from omnistage.models.qwen3_omni.checkpoint_io import plan_shards, write_checkpoint
from omnistage.utils import deep_merge
from omnistage.models.qwen3_omni.checkpoint_names import checkpoint_tensors, hf_to_checkpoint_name
from omnistage.models.qwen3_omni.presets import PRESETS, preset_config
from omnistage.models.qwen3_omni.processor_files import write_processor_files
from omnistage.models.qwen3_omni.random_init import random_tensor
from omnistage.models.qwen3_omni.tokenizer import cache_root

DEFAULT_MAX_SHARD_BYTES = 50 * 1000**2
# Modules whose code decides the bytes that make_tiny writes (they key `tiny_checkpoint`'s cache).
_OUTPUT_MODULES = ("make_tiny", "checkpoint_io", "checkpoint_names", "presets", "processor_files",
                   "random_init", "tokenizer")


def hf_parameter_shapes(config: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """(HF in-memory name, shape) of every parameter of transformers' model for `config` (built on meta)."""
    from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

    with torch.device("meta"):
        model = Qwen3OmniMoeForConditionalGeneration(Qwen3OmniMoeConfig(**config))
    return [(name, tuple(p.shape)) for name, p in model.named_parameters()]


# The real Qwen3-Omni-30B-A3B-Instruct generation_config.json, whole: talker defaults, no thinker sampling.
GENERATION_CONFIG = {"talker_max_new_tokens": 4096, "talker_repetition_penalty": 1.05,
                     "talker_temperature": 0.9, "talker_top_k": 50, "talker_top_p": 1.0}
# What a thinker-only variant (-Thinking, -Captioner) changes: no talker or code2wav, so no speech.
THINKER_ONLY = {"enable_audio_output": False}


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")


def _shard_maker(params: list[tuple[str, tuple[int, ...]]], seed: int
                 ) -> Callable[[], dict[str, torch.Tensor]]:
    def make() -> dict[str, torch.Tensor]:
        out = {}
        for hf_name, shape in params:
            # NOTE: clone views: expert slices of one fused tensor share storage, which safetensors refuses
            tensors = checkpoint_tensors(hf_name, random_tensor(hf_to_checkpoint_name(hf_name), shape, seed))
            out.update((n, t if t._base is None else t.clone()) for n, t in tensors)
        return out
    return make


def make_tiny(out_dir: str | Path, seed: int = 0, preset: str = "tiny",
              overrides: dict[str, Any] | None = None, *,
              max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, thinker_only: bool = False) -> Path:
    """Write config, generation config, safetensors (sharded past `max_shard_bytes`), tokenizer and
    processor files into `out_dir`, the real repo's file set; `overrides` deep-merge into the preset's config.
    `thinker_only`: a -Thinking/-Captioner-like folder (enable_audio_output false, no talker or code2wav)."""
    import transformers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = deep_merge(preset_config(preset), overrides or {})
    if thinker_only:
        dropped = ("talker_config", "code2wav_config")
        config = {k: v for k, v in config.items() if k not in dropped} | THINKER_ONLY
    # NOTE: without transformers_version, transformers 5.17 warns that the tokenizer has "an incorrect regex"
    config.update(dtype="float32", transformers_version=transformers.__version__)
    params = hf_parameter_shapes(config)
    groups = plan_shards([4 * torch.Size(shape).numel() for _, shape in params], max_shard_bytes)
    write_checkpoint(out, [_shard_maker([params[i] for i in g], seed) for g in groups])
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", GENERATION_CONFIG)
    write_processor_files(out, config)
    return out


def code_version() -> str:
    """Hash of the code that decides make_tiny's output (ours, transformers' and torch's versions)."""
    import transformers

    digest = hashlib.sha256(f"{transformers.__version__} {torch.__version__}".encode())
    for module in _OUTPUT_MODULES:
        digest.update((Path(__file__).parent / f"{module}.py").read_bytes())
    return digest.hexdigest()[:12]


def tiny_checkpoint(preset: str = "tiny", seed: int = 0, thinker_only: bool = False) -> Path:
    """A make_tiny folder in omnistage's cache, written on first use (safe against concurrent writers)."""
    kind = f"{preset}-thinker-only" if thinker_only else preset
    path = cache_root() / "tiny" / f"{kind}-{seed}-{code_version()}"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    make_tiny(tmp, seed=seed, preset=preset, thinker_only=thinker_only)
    try:
        os.rename(tmp, path)
    except OSError:  # another process finished first
        shutil.rmtree(tmp)
    return path


def add_make_tiny_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("out_dir", help="folder to write the checkpoint into")
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-shard-mb", type=float, default=DEFAULT_MAX_SHARD_BYTES / 1000**2)
    parser.add_argument("--thinker-only", action="store_true",
                        help="text output only, like -Thinking/-Captioner (enable_audio_output false)")
    return parser


def main_make_tiny(argv: list[str] | None = None) -> int:
    """`omnistage make-tiny OUT_DIR [--preset tiny] [--seed 0] [--max-shard-mb 50] [--thinker-only]`."""
    parser = add_make_tiny_args(argparse.ArgumentParser(prog="omnistage make-tiny"))
    return run_make_tiny(parser.parse_args(argv))


def run_make_tiny(args: argparse.Namespace) -> int:
    max_shard_bytes = int(args.max_shard_mb * 1e6)
    out = make_tiny(args.out_dir, seed=args.seed, preset=args.preset, max_shard_bytes=max_shard_bytes,
                    thinker_only=args.thinker_only)
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"wrote {out} ({size / 1e6:.1f} MB, preset={args.preset}, seed={args.seed})")
    return 0
