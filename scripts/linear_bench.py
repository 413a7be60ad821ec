"""Tiles of the skinny GEMMs (`layers.triton_linear`) on the GPU: for Qwen3-Omni's decode GEMM shapes and row counts,
F.linear (+ `mlp.silu_mul` for gate_up) against `triton_linear` per candidate tile config. Each is timed as --iters
back-to-back calls captured in one CUDA graph (replayed --replays times, us per call) over rotating weight copies
(> 128 MB together, so weights stream from HBM as in the model's step, not from L2); max abs error vs F.linear.
Prints a table and the winners as `triton_linear.CONFIGS` entries (None: cuBLAS wins); writes JSON to --out.
--fp8: the weights in FP8 (`layers.fp8`, per-row scales), the skinny GEMM loading them (weight-only) per tile, also
tiles of wider K (an FP8 tile carries half the bytes), against cuBLAS on the bf16 weights and `fp8.scaled_mm`.

usage: python scripts/linear_bench.py --out FILE [--rows 1,2,16,32,64] [--shapes cp_qkv,cp_gate_up] [--fp8]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from unittest import mock

import torch
import torch.nn.functional as F

from omnistage.layers import fp8, mlp, triton_linear

SHAPES = {  # name: (weight rows N, K, gated)
    "cp_qkv": (4096, 1024, False), "o_proj": (1024, 2048, False), "cp_gate_up": (6144, 1024, True),
    "cp_down": (1024, 3072, False), "cp_lm_head": (2048, 1024, False), "talker_qkv": (2560, 1024, False),
    "talker_gate_up": (1536, 1024, True), "talker_down": (1024, 768, False), "thinker_qkv": (5120, 2048, False),
    "thinker_o_proj": (2048, 4096, False)}
# (BLOCK_N, BLOCK_K, num_warps, num_stages, split_k) at BLOCK_M 16; the first three are the heuristic's
CANDIDATES = [(16, 256, 4, 4, 1), (32, 256, 4, 4, 1), (64, 128, 4, 4, 1), (32, 128, 4, 6, 1), (64, 256, 8, 3, 1),
              (16, 512, 4, 3, 1), (16, 256, 4, 4, 2), (16, 256, 4, 4, 4)]
WIDE = [(32, 128, 4, 4, 1), (64, 128, 4, 3, 1)]  # also at BLOCK_M = the row bucket, for rows > 16
FP8_WIDE_K = [(16, 512, 4, 4, 1), (32, 512, 4, 3, 1), (16, 1024, 4, 3, 1), (32, 1024, 8, 2, 1)]  # with --fp8
STREAM_BYTES = 128 << 20


def time_graph(fn: Callable[[], object], replays: int = 10) -> float:
    """ms of one replay of `fn` captured as a CUDA graph."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays


def time_us(call: Callable[[torch.Tensor], torch.Tensor], weights: list[torch.Tensor], iters: int,
            replays: int) -> float:
    """us a call of `call` over `weights` in turn, `iters` calls captured in one graph (`time_graph`)."""
    def calls() -> None:
        for i in range(iters):
            call(weights[i % len(weights)])
    return time_graph(calls, replays) * 1e3 / iters


def candidates(m: int, fp8_weights: bool = False) -> list[triton_linear.Config]:
    bucket = triton_linear.m_bucket(m)
    extra = [(16, *c) for c in FP8_WIDE_K] if fp8_weights else []
    return [(16, *c) for c in CANDIDATES] + extra + ([(bucket, *c) for c in WIDE] if bucket > 16 else [])


def stream_weights(n: int, k: int, iters: int) -> list[torch.Tensor]:
    """Copies of a `[n, k]` weight, together > STREAM_BYTES (or one per call)."""
    g = torch.Generator("cuda").manual_seed(n + k)
    copies = min(iters, max(2, math.ceil(STREAM_BYTES / (n * k * 2))))
    return [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * k**-0.5 for _ in range(copies)]


def bench(name: str, m: int, weights: list[torch.Tensor], iters: int, replays: int, fp8_weights: bool = False
          ) -> dict:
    n, k, gated = SHAPES[name]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=torch.Generator("cuda").manual_seed(m))
    eager = (lambda w: mlp.silu_mul(F.linear(x, w))) if gated else (lambda w: F.linear(x, w))
    skinny = (lambda w: triton_linear.linear_silu_mul(x, w)) if gated else (lambda w: triton_linear.linear(x, w))
    quantized = [fp8.quantize_rows(w) for w in weights] if fp8_weights else weights
    if fp8_weights:  # NOTE: the reference stays the bf16 weights' F.linear: the error shown includes E4M3's
        skinny = ((lambda w: triton_linear.linear_silu_mul(x, *w)) if gated
                  else (lambda w: triton_linear.linear(x, w[0], None, w[1])))
    ref = eager(weights[0]).float()
    key = (n, k, triton_linear.m_bucket(m), gated)
    current = triton_linear.config(n, k, m, gated, fp8_weights)
    res = {"cublas_us": time_us(eager, weights, iters, replays), "current": list(current), "tiles": {},
           "max_err": {}, "weight_mb": n * k * (1 if fp8_weights else 2) / 2**20}
    if fp8_weights and not gated:
        res["scaled_mm_us"] = time_us(lambda w: fp8.scaled_mm(x, w[0], w[1], None), quantized, iters, replays)
    table = triton_linear.FP8_CONFIGS if fp8_weights else triton_linear.CONFIGS
    for tiles in dict.fromkeys([current, *candidates(m, fp8_weights)]):
        with mock.patch.dict(table, {key: tiles}):
            try:
                res["max_err"][str(tiles)] = (skinny(quantized[0]).float() - ref).abs().max().item()
                res["tiles"][str(tiles)] = time_us(skinny, quantized, iters, replays)
            except Exception as e:  # NOTE: a tile past the shared-memory limit fails to launch; keep the others
                res["tiles"][str(tiles)] = f"{type(e).__name__}: {str(e)[:100]}"
    ok = {t: us for t, us in res["tiles"].items() if isinstance(us, float)}
    best = min(ok, key=ok.get)
    res.update(best=best, best_us=ok[best], current_us=ok.get(str(current)),
               best_tb_s=res["weight_mb"] * 2**20 / ok[best] / 1e6, ref_max=ref.abs().max().item())
    return res


def winners(results: dict, rows: list[int], fp8_weights: bool = False) -> list[str]:
    """Per (shape, row bucket): the tiles with the least summed time over the bucket's rows, or None where
    F.linear's sum is less (FP8: always the tiles, there is no bf16 weight to fall back on); as lines of
    `triton_linear.CONFIGS` (`FP8_CONFIGS`)."""
    lines = []
    for name, (n, k, gated) in SHAPES.items():
        buckets: dict[int, list[int]] = {}
        for m in rows:
            if name in results and str(m) in results[name]:
                buckets.setdefault(triton_linear.m_bucket(m), []).append(m)
        for bucket, ms in buckets.items():
            runs = [results[name][str(m)] for m in ms]
            tiles = [t for t in runs[0]["tiles"] if all(isinstance(r["tiles"].get(t), float) for r in runs)]
            best = min(tiles, key=lambda t: sum(r["tiles"][t] for r in runs))
            ours, cublas = sum(r["tiles"][best] for r in runs), sum(r["cublas_us"] for r in runs)
            value = best if ours <= cublas or fp8_weights else "None"
            lines.append(f"    ({n}, {k}, {bucket}, {gated}): {value},  # {name} rows {ms}: "
                         f"{ours / len(ms):.1f} us vs cuBLAS {cublas / len(ms):.1f} us")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--rows", default="1,2,16,32,64")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--replays", type=int, default=5)
    p.add_argument("--fp8", action="store_true", help="FP8 weights (weight-only skinny GEMM) against bf16 cuBLAS")
    a = p.parse_args()
    rows, t0 = [int(m) for m in a.rows.split(",")], time.time()
    results: dict = {"device": torch.cuda.get_device_name()}
    print(f"{'shape':16} {'M':>3} {'cuBLAS us':>9} {'current us':>10} {'best us':>8} {'TB/s':>5} {'err':>8}  best tiles")
    for name in a.shapes.split(","):
        weights = stream_weights(*SHAPES[name][:2], a.iters)
        for m in rows:
            r = results.setdefault(name, {})[str(m)] = bench(name, m, weights, a.iters, a.replays, a.fp8)
            print(f"{name:16} {m:3} {r['cublas_us']:9.2f} {r['current_us'] or float('nan'):10.2f} {r['best_us']:8.2f} "
                  f"{r['best_tb_s']:5.2f} {r['max_err'][r['best']]:8.2e}  {r['best']}", flush=True)
            with open(a.out, "w") as f:
                json.dump(results, f, indent=1)
    lines = winners(results, rows, a.fp8)
    results["configs"] = lines
    with open(a.out, "w") as f:
        json.dump(results, f, indent=1)
    table = "FP8_CONFIGS: dict[tuple[int, int, int, bool], Config]" if a.fp8 else \
        "CONFIGS: dict[tuple[int, int, int, bool], Config | None]"
    print("\n# paste into layers/triton_linear.py (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, split_k)")
    print(f"{table} = {{\n" + "\n".join(lines) + "\n}")
    print(f"# {time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()
