"""The transformers peer: the read-aloud requests through `Qwen3OmniMoeForConditionalGeneration.generate(
return_audio=True)` on the same seeded random weights as the server's `--load-format dummy`, in batches.

generate() does not stream, so a request's TTFT = TTFP = E2E = its batch's time, RTF = E2E / its audio
seconds, and a row's concurrency is the batch size. A batch is forced to its longest request's lengths
(min_new_tokens = max_new_tokens for the thinker and the talker, so EOS cannot end it early).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import torch

from omnistage.bench.metrics import RequestResult, summarize
from omnistage.bench.workload import BenchRequest, Budget, TokenCounter, build_requests, forced_lengths

WARMUP_TOKENS, WARMUP_FRAMES = 4, 8


def build_hf_model(model_dir: str, device: str | torch.device, dtype: str | torch.dtype | None = None,
                   seed: int = 0) -> torch.nn.Module:
    """transformers' model for model_dir's config.json on `device` with the seeded values our dummy
    weights have: the talker's routers and experts too, which transformers leaves at zero / unset."""
    from transformers import Qwen3OmniMoeForConditionalGeneration

    from omnistage.models.qwen3_omni.model import _default_dtype, load_config, resolve_dtype
    from omnistage.models.qwen3_omni.weights import init_reference_weights

    device = torch.device(device)
    dtype = resolve_dtype(dtype, device)
    with torch.device(device), _default_dtype(dtype):
        model = Qwen3OmniMoeForConditionalGeneration(load_config(model_dir))
    model.eval().requires_grad_(False)
    init_reference_weights(model, seed)
    return model


def _left_padded(ids: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, ids))
    input_ids = torch.full((len(ids), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for row, x in enumerate(ids):
        input_ids[row, width - len(x):] = torch.tensor(x)
        mask[row, width - len(x):] = 1
    return input_ids.to(device), mask.to(device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def generate_batch(model: torch.nn.Module, ids: list[list[int]], pad_id: int, *, text_tokens: int, frames: int,
                   force: bool, voice: str = "Ethan") -> tuple[float, list[int]]:
    """One generate() call on a batch of prompts: (seconds, each row's audio samples)."""
    input_ids, mask = _left_padded(ids, pad_id, model.device)
    # NOTE: generate() keeps the codes of talker_max_new_tokens - 1 steps, so one more step gives `frames`
    kw = {"thinker_max_new_tokens": text_tokens, "thinker_do_sample": False, "talker_max_new_tokens": frames + 1}
    if force:
        kw.update(thinker_min_new_tokens=text_tokens, talker_min_new_tokens=frames + 1)
    _sync(model.device)
    t0 = time.perf_counter()
    _, wavs = model.generate(input_ids=input_ids, attention_mask=mask, speaker=voice, return_audio=True, **kw)
    _sync(model.device)
    seconds = time.perf_counter() - t0
    if torch.is_tensor(wavs):  # one waveform [1, 1, S], or [B, 1, S] from versions without per-row lengths
        wavs = list(wavs.reshape(len(ids), -1)) if wavs.shape[0] == len(ids) else [wavs.reshape(-1)]
    return seconds, [int(w.numel()) for w in wavs]


def _run_row(model: torch.nn.Module, prompts: list[list[int]], reqs: list[BenchRequest], batch: int,
             deadline: float, args: argparse.Namespace, pad_id: int) -> list[RequestResult]:
    """Batches of `batch` requests until the requests or the row's time run out (the first always runs)."""
    results: list[RequestResult] = []
    last = 0.0
    for k in range(0, len(reqs), batch):
        if results and time.perf_counter() + last > deadline:
            break
        lengths = [forced_lengths(r, args.max_tokens, args.max_frames, args.answer_scale) for r in reqs[k:k + batch]]
        text, frames = max(t for t, _ in lengths), max(f for _, f in lengths)
        send = time.perf_counter()
        try:
            last, samples = generate_batch(model, prompts[k:k + batch], pad_id, text_tokens=text, frames=frames,
                                           force=args.random_weights, voice=args.voice)
        except (RuntimeError, ValueError, TypeError, IndexError) as e:  # out of memory, a batch it rejects, ...
            results += [RequestResult(send=send, error=f"{type(e).__name__}: {e}"[:300])] * len(lengths)
            break
        results += [RequestResult(send=send, ok=True, text_times=[last], audio_times=[last], audio_samples=n,
                                  audio_chunks=[n], end=last, prompt_tokens=len(ids), output_tokens=text)
                    for n, ids in zip(samples, prompts[k:k + batch])]
    return results


def run_hf(args: argparse.Namespace, counter: TokenCounter, budget: Budget, plan: list[tuple[int, int]],
           on_row: Callable[[dict], None] | None = None) -> tuple[list[dict], list[dict]]:
    """Rows of the hf backend for (prompt tokens, batch size) in `plan`; also returns the rows skipped."""
    from omnistage.models.qwen3_omni.prompt import PromptProcessor

    if not args.model_dir:
        raise SystemExit("--backend hf needs --model-dir (a folder with config.json and the tokenizer files)")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    t0 = time.perf_counter()
    model = build_hf_model(args.model_dir, device, args.dtype, args.weights_seed)
    processor = PromptProcessor(args.model_dir)
    pad_id = processor.tokenizer.pad_token_id
    print(f"hf: model built on {device} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    if args.warmup:
        ids = processor(build_requests(plan[0][0], 1, args.seed + 1, counter)[0].messages).input_ids
        generate_batch(model, [ids], pad_id, text_tokens=WARMUP_TOKENS, frames=WARMUP_FRAMES, force=True,
                       voice=args.voice)
    rows, skipped = [], []
    for i, (p, batch) in enumerate(plan):
        if budget.left() <= 0:
            skipped.append({"prompt_tokens": p, "concurrency": batch})
            continue
        deadline = budget.row_deadline(len(plan) - i)
        reqs = build_requests(p, max(args.num_prompts, batch), args.seed, counter)
        prompts = [processor(r.messages).input_ids for r in reqs]
        start = time.perf_counter()
        results = _run_row(model, prompts, reqs, batch, deadline, args, pad_id)
        rows.append(summarize(results, backend="hf", concurrency=batch, prompt_tokens=p, start=start))
        if on_row is not None:
            on_row(rows[-1])
    _mark_best(rows)
    return rows, skipped


def _mark_best(rows: list[dict]) -> None:
    """`best_batch: true` on the batch size of highest request throughput at each prompt length."""
    for p in {r["prompt_tokens"] for r in rows}:
        done = [r for r in rows if r["prompt_tokens"] == p and r["request_throughput"]]
        if done:
            max(done, key=lambda r: r["request_throughput"])["best_batch"] = True
