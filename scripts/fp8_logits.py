"""FP8 against bf16 at full size on the GPU (issue 23): the thinker and the talker built with seeded random weights
(`--load-format dummy`), a prompt of random text ids run through each decoder; then the same modules quantised in
place (`--quantization`, fp8 or fp8-all) and run again. Per layer and for the logits: relative error and cosine; the
share of positions whose argmax agrees (teacher-forced, as 64+ greedy steps would be scored). Random weights: a check
of the kernels' and scales' arithmetic at the real shapes, not of speech quality.

    python scripts/fp8_logits.py MODEL_DIR [--tokens 320] [--device cuda] [--quantization fp8] [--json FILE] \
        [--weight-only]  (also without FP8 dots in the experts' prefill, under "weight_only")
(MODEL_DIR: a folder with the checkpoint's config.json, e.g. scripts/bench_model_dir.py's.)
"""

from __future__ import annotations

import argparse
import json
from unittest import mock

import torch
import torch.nn.functional as F

from omnistage.config_rules import QUANTIZATIONS
from omnistage.layers import triton_fused_moe
from omnistage.layers.attention import allocate_kv_cache
from omnistage.layers.context import StaticBlockAllocator, forward_context
from omnistage.models.qwen3_omni.model import build_stage, load_config, quantize_stage


def run(m: torch.nn.Module, embeds: torch.Tensor, head: str) -> list[torch.Tensor]:
    """Each decoder layer's output stream (float32, on the host), then the logits of `head`."""
    outs: list[torch.Tensor] = []
    hooks = [layer.register_forward_hook(lambda _m, _i, o: outs.append((o[0] + o[1]).float().cpu()))
             for layer in m.model.layers]
    alloc = StaticBlockAllocator(1, len(embeds) + 16, 16, embeds.device)
    allocate_kv_cache(m, alloc.num_blocks, 16, embeds.dtype, embeds.device)
    try:
        with torch.inference_mode(), forward_context(alloc.context([len(embeds)], [0])):
            hidden, _ = m.model(embeds, torch.arange(len(embeds), device=embeds.device))
            logits = getattr(m, head)(hidden).float().cpu()
    finally:
        for h in hooks:
            h.remove()
    return outs + [logits]


def compare(ref: list[torch.Tensor], got: list[torch.Tensor]) -> dict:
    rel = [((a - b).norm() / b.norm()).item() for a, b in zip(got, ref)]
    cos = F.cosine_similarity(got[-1], ref[-1], dim=-1)
    agree = (got[-1].argmax(-1) == ref[-1].argmax(-1)).float().mean().item()
    return {"layer_rel_err": [round(r, 5) for r in rel[:-1]], "logits_rel_err": round(rel[-1], 5),
            "logits_cos_mean": round(cos.mean().item(), 5), "logits_cos_min": round(cos.min().item(), 5),
            "argmax_agree": round(agree, 4), "positions": len(cos)}


def stage_check(config, stage: str, tokens: int, device: str, quantization: str, weight_only: bool) -> dict:
    m = build_stage(config, stage, load_format="dummy", device=device, dtype=torch.bfloat16)
    g = torch.Generator(device=device).manual_seed(0)
    if stage == "thinker":
        ids = torch.randint(1000, min(150000, m.model.embed_tokens.num_embeddings), (tokens,), device=device,
                            generator=g)
        embeds, head = m.model.embed_tokens(ids), "compute_logits"
    else:
        ids = torch.randint(0, m.model.codec_embedding.num_embeddings, (tokens,), device=device, generator=g)
        embeds, head = m.model.codec_embedding(ids), "codec_head"
    ref = run(m, embeds, head)
    before = sum(t.nbytes for t in [*m.parameters(), *m.buffers()])
    quantize_stage(m, quantization)
    after = sum(t.nbytes for t in [*m.parameters(), *m.buffers()])
    got = run(m, embeds, head)
    row = {"stage": stage, "quantization": quantization, "bf16_gb": round(before / 1e9, 2),
           "fp8_gb": round(after / 1e9, 2), **compare(ref, got)}
    if weight_only:
        with mock.patch.object(triton_fused_moe, "FP8_DOTS", False):
            row["weight_only"] = compare(ref, run(m, embeds, head))
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("--tokens", type=int, default=320)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quantization", default="fp8", choices=QUANTIZATIONS)
    ap.add_argument("--json", default=None)
    ap.add_argument("--weight-only", action="store_true")
    args = ap.parse_args()
    config = load_config(args.model_dir)
    rows = []
    for s in ("thinker", "talker"):
        rows.append(stage_check(config, s, args.tokens, args.device, args.quantization, args.weight_only))
        torch.cuda.empty_cache()
    for r in rows:
        print(json.dumps(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
