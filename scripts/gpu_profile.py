"""Where a step's time goes on the GPU, per stage, in one process (writes JSON to --out).

1. Talker frame step and thinker decode step (CUDA graphs) at batch 1 / 16 / 64 with the fused kernels
   (`layers/triton_ops.py`) on and off, and the kernels of one step (the static path run eagerly under the
   profiler: kernel count, top kernels by GPU time).
2. Code2wav chunk steps (graphs) at batch 1 / 16 / 64, first and later chunks, fused SnakeBeta on and off,
   cuDNN autotuning on; the top kernels of a later chunk at batch 16.
3. `kernels`: the talker frame's kernels at batch 1 and 64, talker / thinker steps with each fast-path switch
   off, code2wav's replays per chunk shape.
4. Thinker prefill: N prompts of P tokens through `Omni.chat` with one output token (TTFT under load).
5. `h2d`: host time of a small non_blocking host-to-device copy while the stream is busy, from pageable
   and from page-locked memory (does the copy wait for the step in flight?).

usage: python scripts/gpu_profile.py MODEL_DIR --out FILE [--load-format dummy]
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from types import SimpleNamespace

import torch
from gpu_check import sync, talker_steps, thinker_steps, time_steps

from omnistage.engine.cuda_graph import CUDAGraphs
from omnistage.entrypoints.omni import Omni
from omnistage.layers import triton_linear, triton_ops
from omnistage.pipeline.talker.runner import FrameBatch
from omnistage.pipeline.thinker.seq import ThinkerSeq
from omnistage.sampling_params import SamplingParams, TalkerSamplingParams


def top_kernels(fn, dev: torch.device, n: int = 20) -> dict:
    """Kernel launches of one `fn()` and the `n` kernels with the most GPU time."""
    fn()
    sync(dev)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        sync(dev)
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    events.sort(key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in events)
    return {"kernels": sum(e.count for e in events), "gpu_ms": total / 1e3,
            "top": [[e.key[:90], e.count, round(e.device_time_total / 1e3, 3)] for e in events[:n]]}


def with_fused(enabled: bool, runners: list) -> None:
    """Switch the fused kernels and drop the captured graphs (they recapture on first use)."""
    triton_ops.ENABLED = enabled
    for r in runners:
        if r.graphs is not None:
            r.graphs = CUDAGraphs()


def code2wav_steps(omni: Omni, sizes: list[int]) -> dict:
    r = omni.engine.code2wavs[0].runner
    dev = r.streamer.cache.pos.device
    out: dict = {}
    for b in sizes:
        for n, first in r.codes:
            r._capture(b, (n, first))
            key = (b, n, first)
            out[f"b{b}_{'first' if first else 'later'}{n}_ms"] = time_steps(lambda: r.graphs.replay(key), dev, 5)
    return out


def code2wav_report(omni: Omni, sizes: list[int]) -> dict:
    r = omni.engine.code2wavs[0].runner
    dev, later = r.streamer.cache.pos.device, (r.shapes[False][-1], False)
    res = {"graph_fused": code2wav_steps(omni, sizes)}
    res["profile_b16_later"] = top_kernels(lambda: r._forward(16, later), dev)
    with_fused(False, [r])
    res["graph_unfused"] = code2wav_steps(omni, sizes)
    res["profile_b16_later_unfused"] = top_kernels(lambda: r._forward(16, later), dev, 8)
    with_fused(True, [r])
    torch.backends.cudnn.benchmark = True
    r.graphs = CUDAGraphs()
    res["graph_fused_cudnn_benchmark"] = code2wav_steps(omni, sizes)
    torch.backends.cudnn.benchmark = False
    return res


def step_report(omni: Omni, sizes: list[int]) -> dict:
    tk, th = omni.engine.talkers[0], omni.engine.thinker
    res: dict = {}
    for fused in (True, False):
        with_fused(fused, [tk.runner, th.runner])
        res[f"talker_fused_{fused}"] = talker_steps(omni, sizes, 200)
        res[f"thinker_fused_{fused}"] = thinker_steps(omni, sizes, 200)
    with_fused(True, [tk.runner, th.runner])
    graphs = tk.runner.graphs
    tk.runner.graphs = None  # the static path, eagerly: the profiler sees every kernel of the step
    res["talker_profile_b16"] = profile_talker(omni, 16)
    tk.runner.graphs = graphs
    graphs, th.runner.graphs = th.runner.graphs, None
    res["thinker_profile_b16"] = profile_thinker(omni, 16)
    th.runner.graphs = graphs
    return res


# the fast path's switches, each turned off alone in `kernel_report` (module, flag)
SWITCHES = {"triton_linear": (triton_linear, "ENABLED")}


def switch_ablation(omni: Omni) -> dict:
    """Talker and thinker graph steps at batch 1 and 64 with each of `SWITCHES` off (graphs recaptured)."""
    tk, th = omni.engine.talkers[0], omni.engine.thinker
    res = {}
    for name, (module, flag) in SWITCHES.items():
        setattr(module, flag, False)
        with_fused(True, [tk.runner, th.runner])
        res[f"{name}_off"] = {"talker": talker_steps(omni, [1, 64], 200), "thinker": thinker_steps(omni, [1, 64], 200)}
        setattr(module, flag, True)
    with_fused(True, [tk.runner, th.runner])
    return res


def kernel_report(omni: Omni) -> dict:
    """Talker and thinker graph steps, the kernels of one talker frame at batch 1 and 64, the steps with each
    fast-path switch off; code2wav's graph replays per chunk shape, and the kernels of its first and its
    largest later chunk at batch 16."""
    tk, r = omni.engine.talkers[0], omni.engine.code2wavs[0].runner
    res: dict = {"talker_steps": talker_steps(omni, [1, 16, 64], 200),
                 "thinker_steps": thinker_steps(omni, [1, 64], 200)}
    res["switches"] = switch_ablation(omni)
    graphs, tk.runner.graphs = tk.runner.graphs, None
    res.update({f"talker_profile_b{b}": profile_talker(omni, b, 40) for b in (1, 64)})
    tk.runner.graphs = graphs
    res["code2wav_graph_ms"] = code2wav_steps(omni, [1, 16, 64])
    for shape in ((r.shapes[True][0], True), (r.shapes[False][-1], False)):
        name = f"code2wav_profile_b16_{'first' if shape[1] else 'later'}{shape[0]}"
        res[name] = top_kernels(lambda: r._forward(16, shape), r.streamer.cache.pos.device, 40)
    return res


def profile_talker(omni: Omni, b: int, n: int = 25) -> dict:
    st = omni.engine.talkers[0]
    ids = [f"prof{i}" for i in range(b)]
    tables = [st.blocks.allocate(r, 264) for r in ids]
    fb = FrameBatch(torch.randn(b, st.runner.inputs.shape[1], device=st.device, dtype=st.dtype) * 0.02, [1] * b,
                    [200] * b, tables, [TalkerSamplingParams(ignore_eos=True)] * b, list(range(b)), [10] * b,
                    [st.penalties.scratch] * b)
    out = top_kernels(lambda: st.runner.run(fb), st.device, n)
    for r in ids:
        st.blocks.release(r)
    return out


def profile_thinker(omni: Omni, b: int) -> dict:
    st = omni.engine.thinker
    ids = [f"prof{i}" for i in range(b)]
    tables = [st.blocks.allocate(r, 264) for r in ids]
    seqs = [ThinkerSeq(SimpleNamespace(sampling=SamplingParams(ignore_eos=True), seed=i), None, None, None, None,
                       num_computed=200, output_ids=[100 + i], slot=st.penalties.scratch) for i in range(b)]
    out = top_kernels(lambda: st.runner.run(seqs, tables), st.device, 25)
    for r in ids:
        st.blocks.release(r)
    return out


def h2d_report(dev: torch.device) -> dict:
    x = torch.randn(8192, 8192, device=dev)
    dst = torch.empty(64, dtype=torch.long, device=dev)
    out = {}
    for name, make in (("pageable", lambda: torch.arange(64)), ("pinned", lambda: torch.arange(64).pin_memory())):
        times = []
        for _ in range(5):
            for _ in range(10):
                x @ x  # ~0.2 s queued on the stream
            start = time.perf_counter()
            dst.copy_(make(), non_blocking=True)
            times.append(time.perf_counter() - start)
            sync(dev)
        out[f"{name}_copy_ms"] = 1e3 * min(times)
    return out


def prefill_report(omni: Omni, n: int, tokens: int) -> dict:
    prompt = " ".join(["word"] * tokens)
    res = {}
    for label in ("cold", "warm"):
        start = time.perf_counter()
        omni.chat([[{"role": "user", "content": prompt}]] * n, modalities=["text"],
                  sampling={"temperature": 0, "max_tokens": 1})
        res[f"{label}_s"] = time.perf_counter() - start
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir")
    p.add_argument("--out", required=True)
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--sizes", default="1,16,64")
    p.add_argument("--parts", default="steps,code2wav,prefill")
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    res: dict = {"fused_ops": triton_ops.triton is not None}
    start = time.perf_counter()
    omni = Omni(a.model_dir, load_format=a.load_format)
    res["build_s"] = time.perf_counter() - start
    sizes = [int(s) for s in a.sizes.split(",")]
    parts = {"steps": lambda: step_report(omni, sizes), "code2wav": lambda: code2wav_report(omni, sizes),
             "prefill": lambda: {f"n{n}": prefill_report(omni, n, 160) for n in (1, 64)},
             "h2d": lambda: h2d_report(omni.engine.thinker.device), "kernels": lambda: kernel_report(omni)}
    for name in a.parts.split(","):
        t = time.perf_counter()
        try:
            res[name] = parts[name]()
        except Exception as e:  # NOTE: keep the other parts' numbers when one part fails
            logging.exception("part %s failed", name)
            res[name] = {"error": repr(e)}
        res[f"{name}_wall_s"] = time.perf_counter() - t
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))
    omni.engine.shutdown()


if __name__ == "__main__":
    main()
