"""A burst of spoken-question prompts through the serving process's prompt processing (decode, log-mel
features, template), in a pool of threads as the server runs it: torch's intra-op threads left at their
default (every pool thread then runs its own team of as many threads as cores) against one a thread.
Prints, per setting and repeat, the burst's wall time and the mean time to each prompt's completion.

usage: python scripts/prompt_burst.py [--requests 64] [--threads 20] [--repeats 3]
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

from omnistage.bench.media_workload import build_media_requests
from omnistage.models.qwen3_omni.prompt import PromptProcessor


class _Words:
    def count(self, text: str) -> int:
        return len(text.split())


def burst(processor: PromptProcessor, requests: list, threads: int, intra_op: int) -> tuple[float, float]:
    """(wall s, mean completion s) of processing `requests` at once in `threads` threads of `intra_op` each."""
    with ThreadPoolExecutor(threads, initializer=torch.set_num_threads, initargs=(intra_op,)) as pool:
        list(pool.map(lambda _: None, range(threads * 2)))  # the threads exist before the clock starts
        t0 = time.perf_counter()
        done = list(pool.map(lambda r: (processor(r.messages), time.perf_counter() - t0)[1], requests))
    return time.perf_counter() - t0, sum(done) / len(done)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--threads", type=int, default=min(32, (os.cpu_count() or 1) + 4))
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        processor = PromptProcessor(write_model_dir(Path(d) / "model"))
    print(f"{os.cpu_count()} cores, torch {torch.get_num_threads()} intra-op threads, {args.threads} pool threads, "
          f"{args.requests} spoken-question prompts a burst")
    seed, default = 0, torch.get_num_threads()
    for _ in range(args.repeats):
        for intra_op in (default, 1):
            seed += 1  # NOTE: new bytes each burst (the feature cache would answer a repeat)
            wall, mean = burst(processor, build_media_requests("spoken-question", args.requests, seed, _Words()),
                               args.threads, intra_op)
            print(f"intra-op {intra_op}: burst {wall * 1e3:.0f} ms, mean completion {mean * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
