"""`omnistage bench`: the read-aloud sweep (prompt length x concurrency) against an OpenAI-compatible
endpoint (`--backend omnistage`), or through transformers' generate() on the same seeded random weights
(`--backend hf`, concurrency = batch size); the media workloads (spoken-question, visual-question, video,
video-audio: bench/media_workload.py) sweep concurrency at the same output lengths, against a server only.
Rows go into OUTPUT_DIR/results.json (added to when it exists), then results.md and the plots are made
from it."""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import sys
import time

from omnistage.bench.media_workload import MEDIA_WORKLOADS, add_media_args, media_fields, workload_requests
from omnistage.bench.metrics import summarize
from omnistage.bench.report import add_results, markdown, run_meta, write_report
from omnistage.bench.speech import CLIPS
from omnistage.bench.workload import BenchRequest, Budget, TokenCounter, token_counter

WORKLOADS = ("read-aloud", *MEDIA_WORKLOADS)  # and "realtime" (--realtime)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def add_bench_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--backend", choices=["omnistage", "hf"], default="omnistage",
                   help="omnistage: any OpenAI-compatible server at --base-url; hf: transformers in this process")
    p.add_argument("--base-url", default="http://127.0.0.1:8091")
    p.add_argument("--model", default=None, help="served model name (default: the first of /v1/models)")
    p.add_argument("--api-key", default=os.environ.get("OMNISTAGE_API_KEY"))
    p.add_argument("--workload", choices=WORKLOADS, default="read-aloud")
    p.add_argument("--prompt-tokens", type=_ints, default=[10, 160, 320, 640], help="read-aloud only")
    add_media_args(p)
    p.add_argument("--concurrency", type=_ints, default=[1, 16, 32, 64], help="hf: batch sizes")
    p.add_argument("--num-prompts", type=int, default=64,
                   help="requests per row: max(this, concurrency, --prompts-per-concurrency x concurrency)")
    p.add_argument("--prompts-per-concurrency", type=int, default=0,
                   help="k: each row sends at least k x c requests (10: the vLLM-Omni blog's 10/160/320/640 prompts "
                        "at c = 1/16/32/64), so a row is mostly steady state rather than one burst of c")
    p.add_argument("--warmup", type=int, default=5, help="requests sent (all at once) before the sweep")
    p.add_argument("--seed", type=int, default=0, help="picks the sentences; request i gets its own seed")
    p.add_argument("--repeat-prompts", action="store_true",
                   help="read-aloud: request i of every row the same text (default: each opens with a tag unique "
                        "to the run, so no row finds an earlier row's prompts in the server's prefix cache)")
    p.add_argument("--random-weights", action="store_true",
                   help="force realistic lengths: text = the sentence's tokens, audio = round(12.5 x duration) "
                        "frames, EOS ignored")
    p.add_argument("--max-tokens", type=int, default=None, help="cap on the text tokens of a request")
    p.add_argument("--max-frames", type=int, default=None, help="cap on the audio frames of a request")
    p.add_argument("--answer-scale", type=float, default=1.0,
                   help="random weights: the forced answer lengths times this (long answers: KV caches that fill)")
    p.add_argument("--voice", default="Ethan")
    p.add_argument("--variant", default=None,
                   help="label of the server configuration (ablation rows), kept in each row")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (default: an approximation, see docs)")
    p.add_argument("--time-budget", type=float, default=0.0,
                   help="seconds for the whole sweep (0: none); rows share what is left evenly")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--output-dir", default="bench-results")
    p.add_argument("--model-dir", default=None, help="hf: model folder (config.json + tokenizer files)")
    p.add_argument("--device", default=None, help="hf: torch device (default: cuda if available)")
    p.add_argument("--dtype", default=None, help="hf: dtype (default: bf16 on accelerators, fp32 on CPU)")
    p.add_argument("--weights-seed", type=int, default=0, help="hf: seed of the random weights (as the server's)")
    p.add_argument("--idle-sessions", type=int, default=0,
                   help="realtime sessions held open streaming silence while the rows run (chat or realtime)")
    r = p.add_argument_group("realtime (--realtime: sessions over /v1/realtime; --concurrency = sessions)")
    r.add_argument("--realtime", action="store_true", help="spoken turns with server VAD instead of chat requests")
    r.add_argument("--clips", type=lambda t: t.split(","), default=["question_2s", "question_20s"],
                   help=f"the spoken turns, one row each: {', '.join(CLIPS)}")
    r.add_argument("--turns", type=int, default=4, help="turns per session in a row")
    r.add_argument("--barge-in-every", type=int, default=3,
                   help="k: turns k, 2k, ... start while the previous answer plays (0: never)")
    r.add_argument("--append-ms", type=int, default=20, help="audio per input_audio_buffer.append")
    r.add_argument("--silence-ms", type=int, default=500, help="server_vad silence_duration_ms")
    r.add_argument("--turn-gap-s", type=float, default=0.5, help="silence after an answer before the next turn")
    r.add_argument("--stagger-s", type=float, default=0.0, help="sessions start spread over this many seconds")
    r.add_argument("--turn-timeout", type=float, default=60.0)
    return p


def _plan(args: argparse.Namespace) -> list[tuple[int | None, int]]:
    """(prompt tokens, concurrency) of each row; a media workload's prompt is its requests' (None here)."""
    prompts = args.prompt_tokens if args.workload == "read-aloud" else [None]
    return [(p, c) for p in prompts for c in args.concurrency]


def row_requests(args: argparse.Namespace, c: int) -> int:
    """Requests a row at concurrency `c` sends."""
    return max(args.num_prompts, c, args.prompts_per_concurrency * c)


async def _sweep(args: argparse.Namespace, counter: TokenCounter, budget: Budget) -> tuple[list[dict], list]:
    import httpx
    from tqdm import tqdm

    from omnistage.bench.client import chat_payload, run_requests, served_model
    from omnistage.bench.realtime import idle_sessions, realtime_sweep
    from omnistage.bench.stage_stats import row_server_stats, scrape_server_counters

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    limits = httpx.Limits(max_connections=max(args.concurrency + [args.warmup, 1]) + 4)
    timeout = httpx.Timeout(args.request_timeout, connect=30.0)
    rows, skipped, plan = [], [], _plan(args)
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, limits=limits, timeout=timeout) as client:
        model = args.model or await served_model(client)
        if args.realtime:
            return await realtime_sweep(args, model, client), skipped

        def bodies(reqs: list[BenchRequest]) -> list[dict]:
            return [chat_payload(r, model=model, random_weights=args.random_weights, voice=args.voice,
                                 max_tokens=args.max_tokens, max_frames=args.max_frames,
                                 answer_scale=args.answer_scale) for r in reqs]

        async with idle_sessions(args, model):  # none unless --idle-sessions
            if args.warmup:
                warm_reqs = workload_requests(args, counter, plan[0][0], args.warmup, args.seed + 1)
                warm, _ = await run_requests(client, bodies(warm_reqs), args.warmup, budget.end, budget.end)
                print(f"warm-up: {sum(r.ok for r in warm)}/{args.warmup} ok "
                      + "; ".join(sorted({r.error for r in warm if not r.ok})), file=sys.stderr)
            for i, (p, c) in enumerate(plan):
                if budget.left() <= 0:
                    skipped.append({"prompt_tokens": p, "concurrency": c})
                    continue
                reqs = workload_requests(args, counter, p, row_requests(args, c), args.seed)
                todo = bodies(reqs)
                counters = await scrape_server_counters(client)
                start = time.perf_counter()
                with tqdm(total=len(todo), desc=f"{args.workload} P={p} c={c}", file=sys.stderr) as bar:
                    results, cancelled = await run_requests(client, todo, c, budget.row_deadline(len(plan) - i),
                                                            budget.end, on_done=bar.update)
                prompt = reqs[0].prompt_tokens if p is None else p
                rows.append(summarize(results, backend="omnistage", concurrency=c, prompt_tokens=prompt,
                                      start=start, cancelled=cancelled))
                rows[-1].update(workload=args.workload, **media_fields(args))
                rows[-1].update(row_server_stats(counters, await scrape_server_counters(client),
                                                 time.perf_counter() - start))
                if args.idle_sessions:
                    rows[-1]["idle_sessions"] = args.idle_sessions
                _print_row(rows[-1])
    return rows, skipped


def _print_row(row: dict) -> None:
    def f(v: float | None, fmt: str) -> str:
        return "-" if v is None else fmt.format(v)

    print(f"{row['backend']} {row.get('workload', 'read-aloud')} P={row['prompt_tokens']} "
          f"c={row['concurrency']}: {row['num_requests']} ok, {row['failed']} failed, "
          f"{f(row['request_throughput'], '{:.3f}')} req/s, "
          f"TTFP {f(row['mean_ttfp_ms'], '{:.0f}')} ms, RTF {f(row['mean_rtf'], '{:.3f}')}, "
          f"{row['stalled_streams']} stalled ({row['stall_s']:.3f} s)", file=sys.stderr)


def run_bench(args: argparse.Namespace) -> int:
    if args.backend == "hf" and args.workload != "read-aloud":
        raise SystemExit(f"--backend hf runs the read-aloud workload only, not {args.workload}")
    counter = token_counter(args.tokenizer)
    budget = Budget(args.time_budget)
    if args.backend == "hf":
        from omnistage.bench.hf_peer import run_hf

        rows, skipped = run_hf(args, counter, budget, _plan(args), on_row=_print_row)
    else:
        rows, skipped = asyncio.run(_sweep(args, counter, budget))
    workload = "realtime" if args.realtime else args.workload
    for row in rows:
        row.setdefault("workload", workload)
        if args.variant:
            row["variant"] = args.variant
    meta = run_meta(shlex.join(["omnistage", *sys.argv[1:]]), workload, backend=args.backend, seed=args.seed,
                    random_weights=args.random_weights, tokenizer=counter.name, num_prompts=args.num_prompts,
                    prompts_per_concurrency=args.prompts_per_concurrency,
                    warmup=args.warmup, time_budget_s=args.time_budget, skipped=skipped,
                    base_url=args.base_url if args.backend == "omnistage" else None)
    results = add_results(args.output_dir, meta, rows)
    write_report(args.output_dir)
    print(markdown(results))
    return 0 if rows and all(r.get("num_requests", r.get("num_turns")) for r in rows) else 1
