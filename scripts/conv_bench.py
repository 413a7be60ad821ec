"""Code2wav's residual convs on the GPU: cuDNN (`F.conv1d`) against `triton_conv.conv1d` per tile candidate, at the
input shapes of a later chunk of --frames frames of the full-size Code2Wav (random weights) and each of --batches
(us a call, 50 calls in one CUDA graph; max error relative to cuDNN's largest output); --channels keeps the convs of
those input channels. Then the whole chunk step (a CUDA graph of `Code2WavStreamer.decode_group`) with
`code2wav_fused.DIRECT_CONVS` empty, as shipped, and with the shapes where Triton's best tile took under half of
cuDNN's time. Prints tables and those shapes as a `DIRECT_CONVS` table; writes JSON to --out.

usage: python scripts/conv_bench.py --out FILE [--batches 1,16,64] [--frames 25] [--channels 192,384] [--tiles 2]
"""

from __future__ import annotations

import argparse
import json
from unittest import mock

import torch
import torch.nn.functional as F
from linear_bench import time_graph, time_us
from transformers import Qwen3OmniMoeConfig

from omnistage.layers import triton_conv
from omnistage.models.qwen3_omni import code2wav_fused
from omnistage.models.qwen3_omni.code2wav_stream import Code2WavStreamer
from omnistage.models.qwen3_omni.model import FULL_SIZE_CONFIG, build_stage

TILES = [(64, 128, 64, 4, 3), (64, 64, 64, 4, 4), (128, 128, 64, 8, 3), (128, 128, 32, 4, 4), (64, 256, 64, 8, 3),
         (128, 256, 64, 8, 3), (32, 128, 64, 4, 3), (128, 64, 64, 4, 3)]  # the first: `triton_conv.CONV_TILES`


def conv_shapes(streamer: Code2WavStreamer, codes: torch.Tensor) -> dict[tuple[int, ...], tuple[int, int]]:
    """(in channels, out channels, kernel, dilation) -> (input length, layers of that shape) in one later chunk."""
    seen: dict[tuple[int, ...], tuple[int, int]] = {}
    inner = code2wav_fused.conv

    def record(layer, h):
        c = layer.conv
        key = (c.in_channels, c.out_channels, c.kernel_size[0], c.dilation[0])
        seen[key] = (h.shape[-1], seen.get(key, (0, 0))[1] + 1)
        return inner(layer, h)

    slots = torch.arange(codes.shape[0], device="cuda")
    streamer.decode_group(slots, codes, True)
    with mock.patch.object(code2wav_fused, "conv", record):
        streamer.decode_group(slots, codes, False)
    return seen


def bench_convs(shapes: dict, batches: list[int], tiles_list: list[tuple[int, ...]]) -> tuple[dict, set]:
    """Rows keyed by shape and batch; (in channels, kernel, dilation, batch, output length) where Triton's best
    tile took under half of cuDNN's time."""
    res, wins = {}, set()
    for (ci, co, k, d), (n, layers) in sorted(shapes.items()):
        w = torch.randn(co, ci, k, device="cuda", dtype=torch.bfloat16) * 0.05
        for b in batches:
            x = torch.randn(b, ci, n, device="cuda", dtype=torch.bfloat16)
            ref = F.conv1d(x, w, dilation=d).float()
            row = {"layers": layers, "cudnn_us": round(time_us(lambda x: F.conv1d(x, w, dilation=d), [x], 50, 5), 1)}
            for tiles in tiles_list:
                err = float((triton_conv.conv1d(x, w, d, tiles).float() - ref).abs().max() / ref.abs().max())
                us = time_us(lambda x: triton_conv.conv1d(x, w, d, tiles), [x], 50, 5)
                row[str(tiles)] = {"us": round(us, 1), "err": round(err, 5)}
            best = min(tiles_list, key=lambda t: row[str(t)]["us"])
            row["best"], row["best_us"] = str(best), row[str(best)]["us"]
            res[f"c{ci}_o{co}_k{k}_d{d}_n{n}_b{b}"] = row
            print(f"{ci:5} {co:5} k{k} d{d} n{n:6} b{b:3} x{layers}: cuDNN {row['cudnn_us']:8.1f} us, "
                  f"best {best} {row['best_us']:8.1f} us (err {row[str(best)]['err']})", flush=True)
            if row["best_us"] < row["cudnn_us"] / 2:
                wins.add((ci, k, d, b, n - (k - 1) * d))
    return res, wins


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--frames", default="25")
    p.add_argument("--channels", default="")
    p.add_argument("--tiles", type=int, default=len(TILES), help="the first N candidates")
    a = p.parse_args()
    batches, keep = [int(b) for b in a.batches.split(",")], {int(c) for c in a.channels.split(",") if c}
    cfg = Qwen3OmniMoeConfig(**json.loads(FULL_SIZE_CONFIG.read_text()))
    model = build_stage(cfg, "code2wav", load_format="dummy", device="cuda", dtype=torch.bfloat16, seed=0)
    streamer = Code2WavStreamer(model, max(batches))
    q, res = cfg.code2wav_config.num_quantizers, {}
    with torch.no_grad():
        for frames in (int(f) for f in a.frames.split(",")):
            shapes = conv_shapes(streamer, torch.randint(0, 2048, (1, q, frames), device="cuda"))
            shapes = {s: v for s, v in shapes.items() if s[2] > 1 and (not keep or s[0] in keep)}
            rows, wins = bench_convs(shapes, batches, TILES[:a.tiles])
            res[f"frames{frames}"] = rows
            res[f"frames{frames}_wins"] = sorted(wins)
            print(f"{frames} frames: Triton < cuDNN / 2 at (channels, kernel, dilation, batch, length)", sorted(wins),
                  flush=True)
            for b in batches:
                slots = torch.arange(b, device="cuda")
                codes = torch.randint(0, 2048, (b, q, frames), device="cuda")
                streamer.decode_group(slots, codes, True)
                won = {w[:3]: frozenset({w[3:]}) for w in wins if w[3] == b}
                for name, convs in (("cudnn", {}), ("shipped", code2wav_fused.DIRECT_CONVS), ("wins", won)):
                    with mock.patch.object(code2wav_fused, "DIRECT_CONVS", convs):
                        ms = time_graph(lambda: streamer.decode_group(slots, codes, False))
                    res[f"chunk{frames}_b{b}_{name}_ms"] = round(ms, 3)
                    print(f"chunk of {frames} frames, batch {b}, {name}: {ms:.3f} ms", flush=True)
    table: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    for w in (w for f in a.frames.split(",") for w in res[f"frames{f}_wins"]):
        table.setdefault(tuple(w[:3]), []).append(tuple(w[3:]))
    print("DIRECT_CONVS =", {k: sorted(v) for k, v in sorted(table.items())})
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
