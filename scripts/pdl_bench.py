"""Programmatic dependent launch (`layers.triton_pdl`) on the GPU: the talker's frame head (codebook 0 sampled, then
the code predictor's 15 passes; one CUDA graph) of the full-size talker with random weights at batch 1 / 16 / 64,
PDL off and on (`OMNISTAGE_PDL` 0 / 1): ms a replay, and whether the codes agree with PDL off. Prints a table;
writes JSON to --out.

usage: python scripts/pdl_bench.py --out FILE [--batches 1,16,64]
"""

from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import torch
from linear_bench import time_graph
from transformers import Qwen3OmniMoeConfig

from omnistage.layers import triton_pdl
from omnistage.layers.sampling import SamplingTensors
from omnistage.models.qwen3_omni.model import FULL_SIZE_CONFIG, build_stage


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--batches", default="1,16,64")
    a = p.parse_args()
    cfg = Qwen3OmniMoeConfig(**json.loads(FULL_SIZE_CONFIG.read_text()))
    talker = build_stage(cfg, "talker", load_format="dummy", device="cuda", dtype=torch.bfloat16, seed=0)
    hidden_size = cfg.talker_config.text_config.hidden_size
    res: dict = {"device": torch.cuda.get_device_name()}
    with torch.no_grad():
        for b in (int(x) for x in a.batches.split(",")):
            hidden = torch.randn(b, hidden_size, device="cuda", dtype=torch.bfloat16)
            params = [SimpleNamespace(temperature=0.9, top_k=50)] * b
            st = SamplingTensors.build(params, list(range(b)), "cuda")
            frame = torch.zeros(b, dtype=torch.long, device="cuda")
            codes = {}
            for mode in (0, 1):
                triton_pdl.ENABLED = mode > 0
                try:
                    codes[mode] = talker.head(hidden, st, frame, None)[0].clone()
                    ms = time_graph(lambda: talker.head(hidden, st, frame, None), 20)
                except Exception as e:  # NOTE: a mode that fails to compile or capture is reported, not fatal
                    res[f"b{b}_pdl{mode}_error"] = repr(e)[:300]
                    print(f"batch {b:3} PDL {mode}: {e!r}"[:300], flush=True)
                    continue
                res[f"b{b}_pdl{mode}_ms"] = round(ms, 3)
                res[f"b{b}_pdl{mode}_same_codes"] = bool(torch.equal(codes[0], codes[mode]))
                print(f"batch {b:3} PDL {mode}: {ms:.3f} ms a frame head, codes as PDL 0: "
                      f"{res[f'b{b}_pdl{mode}_same_codes']}", flush=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
