"""Which of code2wav's convolutions cost what on the GPU: one streaming chunk step (a later chunk, fast path) of
the full-size Code2Wav with random weights under the profiler, conv ops grouped by input shape, most GPU time
first, then every conv layer's shape, dilation and groups. It named the conv that cuDNN runs with its generic
`implicit_convolve_sgemm` (benchmarks/HISTORY.md, seventh session).

usage: python scripts/code2wav_convs.py [--batch 16] [--frames 25]
"""

from __future__ import annotations

import argparse
import json

import torch
from transformers import Qwen3OmniMoeConfig

from omnistage.models.qwen3_omni.code2wav_stream import Code2WavStreamer
from omnistage.models.qwen3_omni.model import FULL_SIZE_CONFIG, build_stage


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--frames", type=int, default=25)
    a = p.parse_args()
    cfg = Qwen3OmniMoeConfig(**json.loads(FULL_SIZE_CONFIG.read_text()))
    model = build_stage(cfg, "code2wav", load_format="dummy", device="cuda", dtype=torch.bfloat16, seed=0)
    streamer = Code2WavStreamer(model, a.batch)
    slots = torch.arange(a.batch, device="cuda")
    codes = torch.randint(0, 2048, (a.batch, cfg.code2wav_config.num_quantizers, a.frames), device="cuda")
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.no_grad():
        streamer.decode_group(slots, codes, True)  # the first chunk; the profiled one is a later chunk
        streamer.decode_group(slots, codes, False)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=acts, record_shapes=True) as prof:
            streamer.decode_group(slots, codes, False)
            torch.cuda.synchronize()
    ops = [e for e in prof.key_averages(group_by_input_shape=True) if e.key == "aten::cudnn_convolution"
           or e.key.startswith("aten::cudnn_convolution_transpose")]
    for e in sorted(ops, key=lambda e: -e.device_time_total):
        print(f"{e.key:36} x{e.count:<2} {e.device_time_total / 1e3:7.3f} ms  {e.input_shapes[:2]}")
    for name, m in model.named_modules():
        if isinstance(m, (torch.nn.Conv1d, torch.nn.ConvTranspose1d)):
            print(f"{name:40} {type(m).__name__:16} {tuple(m.weight.shape)} dilation {m.dilation[0]} groups {m.groups}")


if __name__ == "__main__":
    main()
