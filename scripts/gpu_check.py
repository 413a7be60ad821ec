"""Checks the decode runners on the GPU and times their steps, in one process (writes JSON to --out).

1. Whole requests through `Omni` (graphs on): the first request pays lazy captures, the second is warm.
2. Correctness: the same greedy requests with CUDA graphs, with the runners' static path run eagerly
   (`runner.graphs = None`: must be identical) and with the plain eager engine (`runner = None`).
3. Per-step time of the talker frame step and the thinker decode step at batch 1 / 16 / 64, graph vs
   the static path run eagerly, synchronising after every step as the stages do (`.tolist()`).

usage: python scripts/gpu_check.py MODEL_DIR --out FILE [--device cuda] [--load-format dummy]
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from types import SimpleNamespace

import numpy as np
import torch

from omnistage.entrypoints.omni import Omni
from omnistage.pipeline.talker.runner import FrameBatch
from omnistage.pipeline.thinker.seq import ThinkerSeq
from omnistage.sampling_params import SamplingParams, TalkerSamplingParams

PROMPTS = ["Read this aloud: the quick brown fox jumps over the lazy dog.", "Say hello.",
           "Tell me about the sea.", "Count to five."]


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def chat(omni: Omni, n: int, tokens: int, frames: int) -> tuple[list, float]:
    start = time.perf_counter()
    out = omni.chat([[{"role": "user", "content": PROMPTS[i % 4]}] for i in range(n)],
                    voice=["Ethan", "Chelsie", "Aiden"][:1] * n,
                    sampling={"temperature": 0, "max_tokens": tokens, "ignore_eos": True},
                    talker_sampling={"temperature": 0, "max_frames": frames, "ignore_eos": True})
    return out, time.perf_counter() - start


def set_mode(omni: Omni, mode: str, saved: dict) -> None:
    """'graph', 'static' (runner path run eagerly) or 'eager' (no runner)."""
    for st in [omni.engine.thinker, *omni.engine.talkers]:
        saved.setdefault(id(st), (st.runner, st.runner.graphs if st.runner else None))
        runner, graphs = saved[id(st)]
        st.runner = None if mode == "eager" else runner
        if runner is not None:
            runner.graphs = graphs if mode == "graph" else None


def compare(a: list, b: list) -> dict:
    tok = [np.mean([x == y for x, y in zip(r.token_ids, s.token_ids)]) for r, s in zip(a, b)]
    codes = [float((r.codes == s.codes).mean()) if r.codes.shape == s.codes.shape else 0.0 for r, s in zip(a, b)]
    return {"tokens_equal": float(np.mean(tok)), "codes_equal": float(np.mean(codes)),
            "identical": all(r.token_ids == s.token_ids and np.array_equal(r.codes, s.codes) for r, s in zip(a, b))}


def time_steps(step, dev: torch.device, iters: int = 20) -> float:
    step()
    sync(dev)
    start = time.perf_counter()
    for _ in range(iters):
        step()
        sync(dev)
    return (time.perf_counter() - start) / iters * 1e3


def graph_vs_static(stage, b: int, ctx: int, step_of) -> dict:
    """Time `step_of(tables)()` for `b` rows of `ctx` cached tokens: graphs, then the runner's static path
    run eagerly."""
    ids = [f"bench{b}-{i}" for i in range(b)]
    tables = [stage.blocks.allocate(r, ctx + 64) for r in ids]
    step, runner = step_of(tables), stage.runner
    dev, graphs = runner.context.slot_mapping.device, runner.graphs
    out = {"graph_ms": time_steps(step, dev)}
    runner.graphs = None
    out["static_eager_ms"] = time_steps(step, dev, 5)
    runner.graphs = graphs
    for r in ids:
        stage.blocks.release(r)
    return out


def talker_steps(omni: Omni, sizes: list[int], ctx: int) -> dict:
    st = omni.engine.talkers[0]
    width = st.runner.inputs.shape[1]

    def step_of(b: int):
        def with_tables(tables: list) -> object:
            fb = FrameBatch(torch.randn(b, width, device=st.device, dtype=st.dtype) * 0.02, [1] * b, [ctx] * b,
                            tables, [TalkerSamplingParams(ignore_eos=True)] * b, list(range(b)), [10] * b,
                            [st.penalties.scratch] * b)
            return lambda: st.runner.run(fb)[0][:, 0].tolist()
        return with_tables

    return {b: graph_vs_static(st, b, ctx, step_of(b)) for b in sizes}


def thinker_steps(omni: Omni, sizes: list[int], ctx: int) -> dict:
    st = omni.engine.thinker

    def step_of(b: int):
        seqs = [ThinkerSeq(SimpleNamespace(sampling=SamplingParams(ignore_eos=True), seed=i), None, None, None,
                           None, num_computed=ctx, output_ids=[100 + i], slot=st.penalties.scratch) for i in range(b)]
        return lambda tables: lambda: st.runner.run(seqs, tables)[0].tolist()

    return {b: graph_vs_static(st, b, ctx, step_of(b)) for b in sizes}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir")
    p.add_argument("--out", required=True)
    p.add_argument("--device", default=None)
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--sizes", default="1,16,64")
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--frames", type=int, default=40)
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    res: dict = {}
    start = time.perf_counter()
    omni = Omni(a.model_dir, load_format=a.load_format, device=a.device)
    res["build_s"] = time.perf_counter() - start
    _, res["first_request_s"] = chat(omni, 1, a.tokens, a.frames)
    _, res["warm_request_s"] = chat(omni, 1, a.tokens, a.frames)
    saved: dict = {}
    runs = {}
    for mode in ("graph", "static", "eager"):
        set_mode(omni, mode, saved)
        runs[mode], res[f"batch4_{mode}_s"] = chat(omni, 4, a.tokens, a.frames)
    res["graph_vs_static"] = compare(runs["graph"], runs["static"])
    res["graph_vs_eager"] = compare(runs["graph"], runs["eager"])
    set_mode(omni, "graph", saved)
    sizes = [int(s) for s in a.sizes.split(",")]
    res["talker_step"] = talker_steps(omni, sizes, 200)
    res["thinker_step"] = thinker_steps(omni, sizes, 200)
    if torch.cuda.is_available():
        res["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
    print(json.dumps(res, indent=1))
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    omni.engine.shutdown()


if __name__ == "__main__":
    main()
