"""What one `VisionGraphRunner.run` costs the thread that launches it (the thinker's, inside a step) against the GPU
time it queues: the full-size vision encoder (seeded random bf16 weights) in graphs, patches from pageable host
memory as the prompt processing leaves them, per run shape and `max_frames` (frames a run may hold).

    python scripts/vision_run_cost.py --out FILE.json [--small]   (--small: the tests' tiny encoder, on the CPU)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from omnistage.models.qwen3_omni.encoders import build_visual
from omnistage.models.qwen3_omni.model import FULL_SIZE_CONFIG
from omnistage.pipeline.thinker.vision_graph import VisionGraphRunner

CASES = {"4 photos 640x480": [[1, 30, 40]] * 4, "1 video 4 s 320x240": [[4, 16, 20]],
         "4 videos 4 s 320x240": [[4, 16, 20]] * 4}


def _case(runner: VisionGraphRunner, grids: list[list[int]], dtype: torch.dtype, n: int) -> dict[str, float]:
    width = runner.pixels.shape[1]
    pixels = [torch.randn(t * h * w, width).to(dtype) for t, h, w in grids]
    host, gpu, timed = [], [], runner.graphs is not None
    for _ in range(n):
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2)) if timed else (None, None)
        if start is not None:
            start.record()
        t0 = time.perf_counter()
        runner.run(pixels, grids)
        host.append(1e3 * (time.perf_counter() - t0))
        if end is not None:
            end.record()
            end.synchronize()
            gpu.append(start.elapsed_time(end))
    return {"host_ms": statistics.median(host[1:]), "host_first_ms": host[0],
            "gpu_ms": statistics.median(gpu[1:]) if gpu else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--small", action="store_true")
    args = ap.parse_args()
    device = torch.device("cpu" if args.small else "cuda")
    if args.small:
        from test_encoder_attention import VISION  # tests/ on the path
        config = VISION
    else:
        config = json.loads(FULL_SIZE_CONFIG.read_text())["thinker_config"]["vision_config"]
    torch.manual_seed(0)
    with torch.device(device):
        visual = build_visual(config).to(torch.float32 if args.small else torch.bfloat16).eval()
    rows = [64, 128, 256] if args.small else [1280, 5120]
    out = {}
    with torch.inference_mode():
        for frames in (4, 16):
            runner = VisionGraphRunner(visual, rows, frames, device)
            runner.capture()
            for name, grids in CASES.items():
                grids = [[t, h // 8 * 2, w // 8 * 2] for t, h, w in grids] if args.small else grids
                if not runner.fits(grids):
                    continue
                for dtype in (torch.float32, torch.bfloat16):
                    key = f"{name}, max_frames {frames}, {str(dtype)[6:]} patches"
                    out[key] = _case(runner, grids, dtype, 4 if args.small else 12)
                    print(key, {k: round(v, 2) for k, v in out[key].items()}, flush=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
