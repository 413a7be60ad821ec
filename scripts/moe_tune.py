"""Tiles of the fused decode MoE (`layers.triton_fused_moe`) on the GPU: for the thinker's and the talker's expert
shapes at decode batch sizes, the time of `fused_moe` per tile config against the grouped-GEMM path
(`moe.fused_experts_grouped`), routing uniform over the experts; writes JSON to --out. --fp8: the experts in FP8
(`layers.fp8`, per expert per row scales), the fused kernel loading them (weight-only) per tile into
`triton_fused_moe.FP8_TILES`, also tiles of wider K, against the bf16 experts' fused kernel at its tiles.

usage: python scripts/moe_tune.py --out FILE [--batches 1,16,64] [--fp8 | --prefill]
"""

from __future__ import annotations

import argparse
import itertools
import json
from unittest import mock

import torch

from omnistage.layers import fp8, moe, triton_fused_moe

SHAPES = {"thinker": (2048, 768, 128, 8), "talker": (1024, 384, 128, 6)}  # hidden, moe_intermediate, experts, top-k
TILES = [(16, n, k, w, s) for n, k in itertools.product((32, 64, 128), (64, 128, 256))
         for w, s in ((4, 3), (4, 4), (8, 3))]
FP8_TILES = TILES + [(16, n, 512, w, s) for n in (32, 64) for w, s in ((4, 3), (8, 3))]
PREFILL_TILES = [(64, 64, 64, 4, 3), (64, 128, 64, 8, 3), (128, 64, 64, 8, 3), (128, 128, 64, 8, 3),
                 (128, 128, 32, 8, 4), (32, 64, 128, 4, 3), (64, 64, 128, 4, 3), (64, 128, 128, 8, 3)]  # K 128: FP8


def time_ms(fn, iters: int = 50) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def case(h: int, i: int, e: int, k: int, t: int) -> tuple:
    g = torch.Generator("cuda").manual_seed(t)
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, generator=g)
    w13 = torch.randn(e, 2 * i, h, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    w2 = torch.randn(e, h, i, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    ids = torch.rand(t, e, device="cuda", generator=g).topk(k, 1).indices
    weights = torch.softmax(torch.randn(t, k, device="cuda", generator=g), 1).to(torch.bfloat16)
    return x, w13, w2, weights, ids


def tune(h: int, i: int, e: int, k: int, t: int, fp8_experts: bool = False) -> dict:
    args = case(h, i, e, k, t)
    hit = int(torch.unique(args[4]).numel())
    gb = hit * 3 * h * i * (1 if fp8_experts else 2) / 1e9
    res = {"hit_experts": hit, "grouped_ms": time_ms(lambda: moe.fused_experts_grouped(*args, True)), "tiles": {}}
    if fp8_experts:
        res["bf16_fused_ms"] = time_ms(lambda: triton_fused_moe.fused_moe(*args))
        (q13, s13), (q2, s2) = fp8.quantize_rows(args[1]), fp8.quantize_rows(args[2])
        args = (args[0], q13, q2, args[3], args[4], None, (s13, s2))
    for tile in FP8_TILES if fp8_experts else TILES:
        if fp8_experts:
            triton_fused_moe.FP8_TILES = tile
        else:
            (triton_fused_moe.BLOCK_M, triton_fused_moe.BLOCK_N, triton_fused_moe.BLOCK_K,
             triton_fused_moe.NUM_WARPS, triton_fused_moe.NUM_STAGES) = tile
        try:
            res["tiles"][str(tile)] = time_ms(lambda: triton_fused_moe.fused_moe(*args))
        except Exception as ex:  # NOTE: a tile past the shared-memory limit fails to launch; keep the others
            res["tiles"][str(tile)] = repr(ex)[:120]
    ok = {tl: ms for tl, ms in res["tiles"].items() if isinstance(ms, float)}
    best = min(ok, key=ok.get)
    res.update(best=best, best_ms=ok[best], weight_gb=gb, best_tb_s=gb / ok[best], grouped_tb_s=gb / res["grouped_ms"])
    print(f"t={t} h={h}: grouped {res['grouped_ms']:.3f} ms, best {best} {ok[best]:.3f} ms "
          f"({res['best_tb_s']:.2f} TB/s of {gb:.2f} GB)", flush=True)
    return res


def prefill(h: int, i: int, e: int, k: int, t: int) -> dict:
    """Prefill sizes (past `MAX_SLOTS`): the grouped GEMMs with bf16 experts, with FP8 ones (activations quantised
    per row, `torch._scaled_grouped_mm`), that quantisation alone, and the fused kernel's FP8 loads (the path
    `moe.fused_experts` takes for FP8 experts) as `triton_fused_moe.prefill_plan` picks ("fp8_plan") and at each
    prefill tile, with bf16 rows ("fused") and with rows quantised too ("dots")."""
    args = case(h, i, e, k, t)
    (q13, s13), (q2, s2) = fp8.quantize_rows(args[1]), fp8.quantize_rows(args[2])
    quant = (args[0], q13, q2, args[3], args[4], True, None, (s13, s2))
    res = {"bf16_ms": time_ms(lambda: moe.fused_experts_grouped(*args, True), 10),
           "fp8_grouped_ms": time_ms(lambda: moe.fused_experts_grouped(*quant), 10),
           "quantize_x_ms": time_ms(lambda: fp8.quantize_rows(args[0]), 10),
           "quantize_x_reference_ms": time_ms(lambda: fp8.quantize_rows_reference(args[0]), 10),
           "fp8_plan_ms": time_ms(lambda: moe.fused_experts(*quant[:5], scales=(s13, s2)), 10)}
    for (tile, dots) in itertools.product(PREFILL_TILES, (False, True)):
        name = f"fp8_{'dots' if dots else 'fused'}_{tile}_ms"
        try:
            with mock.patch.object(triton_fused_moe, "prefill_plan", lambda *_, tile=tile, dots=dots: (tile, dots)):
                res[name] = time_ms(lambda: moe.fused_experts(*quant[:5], scales=(s13, s2)), 10)
        except Exception as ex:  # NOTE: a tile past the shared-memory limit fails to launch; keep the others
            res[name] = repr(ex)[:120]
    print(f"t={t} h={h}: " + ", ".join(f"{n} {ms:.3f}" for n, ms in res.items() if isinstance(ms, float)), flush=True)
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--fp8", action="store_true", help="FP8 experts (weight-only) against the bf16 fused kernel")
    p.add_argument("--prefill", action="store_true", help="the grouped GEMMs, bf16 against FP8 experts (`prefill`)")
    a = p.parse_args()
    res: dict = {}
    for name, (h, i, e, k) in SHAPES.items():
        for t in map(int, a.batches.split(",")):
            res[f"{name}_t{t}"] = prefill(h, i, e, k, t) if a.prefill else tune(h, i, e, k, t, a.fp8)
            with open(a.out, "w") as f:
                json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
