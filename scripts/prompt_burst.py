"""A burst of media prompts (`--workload`: spoken-question, visual-question, video, video-audio) through the
serving process's prompt processing (decode, features or patches, template), in a pool of threads as the server runs
it: torch's intra-op threads at their default (each thread then runs a team of as many threads as cores) against one
a thread, and (`--workers N`) through the deploy's `mm_processor_workers` pool of N processes (`ProcessorPool`), fed
from as many threads. Prints, per setting and repeat, the burst's wall time and the mean time to each prompt's
completion.

usage: python scripts/prompt_burst.py [--workload spoken-question] [--requests 64] [--threads 20] [--repeats 3] \
    [--workers 8]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from bench_model_dir import write_model_dir

from omnistage.bench.media_workload import MEDIA_WORKLOADS, build_media_requests
from omnistage.bench.workload import ApproxTokens
from omnistage.models.qwen3_omni.prompt import PromptProcessor
from omnistage.pipeline.processor_pool import ProcessorPool


def burst(processor: PromptProcessor | ProcessorPool, requests: list, threads: int, intra_op: int
          ) -> tuple[float, float]:
    """(wall s, mean completion s) of processing `requests` at once in `threads` threads of `intra_op` each."""
    with ThreadPoolExecutor(threads, initializer=torch.set_num_threads, initargs=(intra_op,)) as pool:
        list(pool.map(lambda _: None, range(threads * 2)))  # the threads exist before the clock starts
        t0 = time.perf_counter()
        done = list(pool.map(lambda r: (processor(r.messages), time.perf_counter() - t0)[1], requests))
    return time.perf_counter() - t0, sum(done) / len(done)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workload", default="spoken-question", choices=MEDIA_WORKLOADS)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--threads", type=int, default=min(32, (os.cpu_count() or 1) + 4))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workers", type=int, default=0, help="also through a pool of this many processes")
    args = p.parse_args()
    counter = ApproxTokens()
    with tempfile.TemporaryDirectory() as d:
        model = write_model_dir(Path(d) / "model")
        processor = PromptProcessor(model)
        pool = ProcessorPool(model, None, None, torch.float32, args.workers) if args.workers else None
        print(f"{os.cpu_count()} cores, torch {torch.get_num_threads()} intra-op threads, {args.threads} pool "
              f"threads, {args.requests} {args.workload} prompts a burst")
        if pool:  # NOTE: the workers' start and first uses, before the clock
            burst(pool, build_media_requests(args.workload, 4 * args.workers, 0, counter), args.threads, 1)
        seed, default = 0, torch.get_num_threads()
        settings = [(f"intra-op {default}", processor, default), ("intra-op 1", processor, 1)]
        settings += [(f"{args.workers} processes", pool, 1)] if pool else []
        for _ in range(args.repeats):
            for name, process, intra_op in settings:
                seed += 1  # NOTE: new bytes each burst (the feature cache would answer a repeat)
                requests = build_media_requests(args.workload, args.requests, seed, counter)
                wall, mean = burst(process, requests, args.threads, intra_op)
                print(f"{name}: burst {wall * 1e3:.0f} ms, mean completion {mean * 1e3:.0f} ms")
        if pool:
            pool.close()


if __name__ == "__main__":
    main()
