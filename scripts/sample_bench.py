"""Times the fused sampler (`layers.triton_sampling.fused_sample`) on the GPU at the code predictor's and
the talker's shapes for several `SEARCH_ARY` values (probes per round of its threshold searches) and warps a program
(`WARPS`): 50 calls captured in one CUDA graph (`linear_bench.time_us`), us per call; prints a table and writes JSON.

usage: python scripts/sample_bench.py --out FILE
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import triton
from linear_bench import time_us

from omnistage.layers import triton_sampling
from omnistage.layers.sampling import SamplingTensors


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    a = p.parse_args()
    res: dict = {}
    shipped = dict(triton_sampling.WARPS)
    for b, vocab, top_k, top_p in ((1, 2048, 50, 0.8), (64, 2048, 50, 0.8), (1, 3072, 50, 1.0)):
        params = [{"temperature": 1.0, "top_k": top_k, "top_p": top_p}] * b
        st = SamplingTensors.build([argparse.Namespace(**q) for q in params], list(range(b)), "cuda")
        logits = torch.randn(b, vocab, device="cuda") * 3
        steps = torch.zeros(b, dtype=torch.long, device="cuda")
        ref = None
        block = triton.next_power_of_2(vocab)
        for ary, warps in itertools.product((2, 4, 8), (1, 2, 4, 8)):
            triton_sampling.SEARCH_ARY, triton_sampling.WARPS[block] = ary, warps
            out = triton_sampling.fused_sample(logits, st, steps)
            ref = out if ref is None else ref
            us = time_us(lambda x: triton_sampling.fused_sample(x, st, steps), [logits], 50, 5)
            key = f"b{b}_v{vocab}_k{top_k}_p{top_p}_ary{ary}_warps{warps}"
            res[key] = {"us": round(us, 2), "same": bool((out == ref).all())}
            print(b, vocab, top_k, top_p, ary, warps, round(us, 2), bool((out == ref).all()), flush=True)
        triton_sampling.WARPS.clear()
        triton_sampling.WARPS.update(shipped)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
