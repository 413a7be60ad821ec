"""The thinker's encoders alone on the GPU: the full-size audio tower and vision encoder (seeded random bf16
weights) per input shape, transformers' own forward with `sdpa` (one attention call per window / image, host
syncs on the device's lengths and grids) against ours (`encode_audio` / `encode_visual`: host indices, one
flash call per layer), with their outputs compared.

    python scripts/encoder_bench.py --out FILE.json [--pressure-gb 2] [--attention] [--new-shapes]

Per case and path: median wall ms of a synchronised call, and from one profiled call the kernels launched,
their summed GPU ms, the host syncs and the six kernels of most GPU time. `--pressure-gb N` repeats the cases with only N GB of the GPU free
(another tensor holds the rest, as the server's KV caches do). `--new-shapes`: only the first, second and third call
of each of several clip lengths and photo grids (what a shape costs the first time).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from omnistage.models.qwen3_omni.encoders import build_audio_tower, build_visual, encode_audio, encode_visual
from omnistage.models.qwen3_omni.model import FULL_SIZE_CONFIG

AUDIO = {"audio 2 s": [2], "audio 5 s": [5], "audio 15 s": [15], "audio 16 x 5 s": [5] * 16}
VISUAL = {"photo 640x480": [[1, 30, 40]], "photo 1280x720": [[1, 44, 80]], "8 photos 640x480": [[1, 30, 40]] * 8,
          "video 4 s 320x240": [[4, 16, 20]], "16 videos 4 s": [[4, 16, 20]] * 16}


def _audio_calls(tower: torch.nn.Module, seconds: list[int]):
    n = max(seconds) * 100
    feats = torch.randn(len(seconds), tower.config.num_mel_bins, n, device="cuda", dtype=torch.bfloat16)
    mask = (torch.arange(n)[None] < torch.tensor(seconds)[:, None] * 100).long()
    flat, lens = feats.permute(0, 2, 1)[mask.cuda().bool()].permute(1, 0), mask.sum(1).cuda()
    return (lambda: tower(flat, feature_lens=lens).last_hidden_state), lambda: encode_audio(tower, feats, mask)


def _visual_calls(visual: torch.nn.Module, grids: list[list[int]]):
    c = visual.config
    grid = torch.tensor(grids)
    px = torch.randn(int(grid.prod(-1).sum()), c.in_channels * c.temporal_patch_size * c.patch_size**2,
                     device="cuda", dtype=torch.bfloat16)
    return (lambda: visual(px, grid_thw=grid.cuda()).pooler_output), lambda: encode_visual(visual, px, grid).embeds


def _measure(fn) -> dict:
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    walls = []
    for _ in range(10):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - t) * 1e3)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = prof.events()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    syncs = sum(e.name in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync") for e in events)
    by_name: dict[str, float] = {}
    for e in kernels:
        by_name[e.name[:60]] = by_name.get(e.name[:60], 0.0) + e.device_time / 1e3
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:6]
    return {"wall_ms": round(statistics.median(walls), 2), "kernels": len(kernels),
            "gpu_ms": round(sum(e.device_time for e in kernels) / 1e3, 2), "syncs_or_copies": syncs,
            "top_kernels_ms": {k: round(v, 2) for k, v in top}}


def _case(calls) -> dict:
    row, outs = {}, {}
    for name, fn in zip(("transformers", "omnistage"), calls):
        row[name] = _measure(fn)
        outs[name] = fn().float()
    a, b = outs["transformers"], outs["omnistage"]
    row["max_abs_diff"] = float((a - b).abs().max())
    row["rel_err"] = float((a - b).norm() / a.norm())
    row["speedup"] = round(row["transformers"]["wall_ms"] / row["omnistage"]["wall_ms"], 2)
    return row


def run(tag: str, tower: torch.nn.Module, visual: torch.nn.Module) -> dict:
    out = {}
    for name, secs in AUDIO.items():
        out[name] = _case(_audio_calls(tower, secs))
        print(tag, name, json.dumps(out[name]), flush=True)
    for name, grids in VISUAL.items():
        out[name] = _case(_visual_calls(visual, grids))
        print(tag, name, json.dumps(out[name]), flush=True)
    return out


def _timed(fn) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    return round((time.perf_counter() - t) / 20 * 1e3, 3)


def attention_backends() -> dict:
    """One layer's attention alone (bf16, not causal) per backend: flash (ours), torch's varlen_attn (cuDNN
    where it picks it) and SDPA's cuDNN backend (one sequence only), for the vision encoder's 1280x720 photo
    (3520 rows, 16 x 72) and the audio tower's 16 x 5 s clips (16 windows of 65 rows, 20 x 64)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from omnistage.layers.attention import varlen_attention

    out = {}
    for name, lens, heads, dim in (("vision 3520", [3520], 16, 72), ("audio 16 x 65", [65] * 16, 20, 64)):
        n = sum(lens)
        q, k, v = (torch.randn(n, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
        row = {"flash": _timed(lambda: varlen_attention(q, k, v, cu, cu, max(lens), max(lens), dim**-0.5,
                                                        causal=False))}
        try:
            from torch.nn.attention.varlen import varlen_attn

            row["varlen_attn"] = _timed(lambda: varlen_attn(q, k, v, cu, cu, max(lens), max(lens)))
        except Exception as e:  # noqa: BLE001 - a probe: record why
            row["varlen_attn"] = repr(e)[:120]
        if len(lens) == 1:
            qt, kt, vt = (x.transpose(0, 1)[None] for x in (q, k, v))
            try:
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    row["sdpa_cudnn"] = _timed(lambda: F.scaled_dot_product_attention(qt, kt, vt))
            except Exception as e:  # noqa: BLE001
                row["sdpa_cudnn"] = repr(e)[:120]
        out[name] = row
        print("attention", name, json.dumps(row), flush=True)
    return out


def _once(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return round((time.perf_counter() - t) * 1e3, 2)


def new_shapes(tower: torch.nn.Module, visual: torch.nn.Module) -> dict:
    """What an input shape costs the first time it is seen: wall ms of the first and the second call of our
    forward per audio length (each a new conv batch) and per photo grid (a new patch count)."""
    out = {}
    cases = [(f"audio {s} s", _audio_calls(tower, [s])[1]) for s in (2, 3, 4, 6, 7, 9, 11, 13)]
    cases += [(f"photo {g[1]}x{g[2]}", _visual_calls(visual, [g])[1]) for g in
              ([1, 32, 32], [1, 24, 38], [1, 40, 26], [1, 28, 36], [1, 44, 80])]
    for name, fn in cases:
        out[name] = {"first_ms": _once(fn), "second_ms": _once(fn), "third_ms": _once(fn)}
        print("new shape", name, json.dumps(out[name]), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--pressure-gb", type=float, default=0)
    ap.add_argument("--attention", action="store_true", help="also time one layer's attention per backend")
    ap.add_argument("--new-shapes", action="store_true", help="only the first calls of new input shapes")
    args = ap.parse_args()
    cfg = json.loads(FULL_SIZE_CONFIG.read_text())["thinker_config"]
    torch.manual_seed(0)
    with torch.device("cuda"):
        tower = build_audio_tower(cfg["audio_config"]).to(torch.bfloat16).eval()
        visual = build_visual(cfg["vision_config"]).to(torch.bfloat16).eval()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    with torch.inference_mode():
        if args.new_shapes:
            result["new_shapes"] = new_shapes(tower, visual)
            return _write(args.out, result)
        if args.attention:
            result["attention"] = attention_backends()
        result["free"] = run("free", tower, visual)
        if args.pressure_gb:
            torch.cuda.empty_cache()
            free, _ = torch.cuda.mem_get_info()
            hog = torch.empty(int(free - args.pressure_gb * 2**30), dtype=torch.uint8, device="cuda")
            result[f"{args.pressure_gb:g} GB free"] = run("pressure", tower, visual)
            del hog
    _write(args.out, result)


def _write(path: str, result: dict) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
