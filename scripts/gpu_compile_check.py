"""Does torch.compile pay inside the talker's CUDA graphs? The full-size talker alone (random weights) in
its decode runner, per variant: eager kernels, the frame head compiled, the whole step compiled.
Per variant: compile + capture time per batch bucket, step time at each batch (synchronised), and the
share of frames equal to the eager-kernel variant's. Writes JSON to --out.

usage: python scripts/gpu_compile_check.py MODEL_DIR --out FILE [--sizes 1,16,64]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from omnistage.engine.block_manager import BlockManager
from omnistage.layers.attention import allocate_kv_cache
from omnistage.models.qwen3_omni.model import build_stage, load_config
from omnistage.pipeline.talker.runner import FrameBatch, TalkerGraphRunner
from omnistage.sampling_params import TalkerSamplingParams

CTX, BLOCK = 200, 16


def variant(talker: torch.nn.Module, name: str) -> None:
    for attr in ("head", "step"):
        talker.__dict__.pop(attr, None)
    if name != "eager":
        bound = getattr(talker, name)
        setattr(talker, name, torch.compile(bound, dynamic=True))


def batch(runner: TalkerGraphRunner, blocks: BlockManager, b: int, vocab: int) -> FrameBatch:
    dev = runner.inputs.device
    tables = [blocks.tables.get(f"r{i}") or blocks.allocate(f"r{i}", CTX + 64) for i in range(b)]
    g = torch.Generator(device=dev).manual_seed(b)
    inputs = torch.randn(b, runner.inputs.shape[1], device=dev, generator=g).to(runner.inputs.dtype) * 0.05
    return FrameBatch(inputs, [1] * b, [CTX] * b, tables, [TalkerSamplingParams(temperature=0, ignore_eos=True)] * b,
                      list(range(b)), [10] * b, torch.zeros(b, vocab, dtype=torch.bool, device=dev))


def measure(talker: torch.nn.Module, blocks: BlockManager, sizes: list[int], name: str) -> dict:
    variant(talker, name)
    runner = TalkerGraphRunner(talker, sizes, max(sizes), blocks.num_blocks, BLOCK, blocks.reserve())
    vocab = talker.codec_head.out_features
    out: dict = {}
    for b in sizes:
        fb = batch(runner, blocks, b, vocab)
        start = time.perf_counter()
        frames, _ = runner.run(fb)
        frames.tolist()
        first = time.perf_counter() - start
        times = []
        for _ in range(20):
            start = time.perf_counter()
            frames, _ = runner.run(fb)
            frames[:, 0].tolist()
            times.append(time.perf_counter() - start)
        out[b] = {"first_call_s": first, "step_ms": sorted(times)[10] * 1e3, "frames": frames.tolist()}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir")
    p.add_argument("--out", required=True)
    p.add_argument("--sizes", default="1,16,64")
    p.add_argument("--variants", default="eager,head,step")
    p.add_argument("--device", default="cuda")
    a = p.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")]
    config = load_config(a.model_dir)
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    talker = build_stage(config, "talker", load_format="dummy", device=a.device, dtype=dtype)
    res: dict = {}
    for name in a.variants.split(","):
        blocks = BlockManager(512, BLOCK)
        allocate_kv_cache(talker.model, blocks.num_blocks, BLOCK, dtype, a.device)
        try:
            res[name] = measure(talker, blocks, sizes, name)
        except Exception as e:  # report and go on to the next variant
            res[name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
        base = res.get("eager", {})
        for b, r in res[name].items():
            if isinstance(r, dict) and b in base:
                same = [x == y for fx, fy in zip(r["frames"], base[b]["frames"]) for x, y in zip(fx, fy)]
                r["equal_to_eager"] = sum(same) / len(same)
        print(name, {b: {k: v for k, v in r.items() if k != "frames"} if isinstance(r, dict) else r
                     for b, r in res[name].items()}, flush=True)
    for r in res.values():
        for v in r.values():
            if isinstance(v, dict):
                v.pop("frames", None)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
