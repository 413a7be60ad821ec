"""Summarises a server's step trace (OMNISTAGE_STEP_TRACE=DIR, one DIR/<stage>.jsonl per stage): per stage
the steps' wall ms (mean, p50, p90, max) over all steps and over those with more input rows than batch rows
(prefills; code2wav's chunks of frames), then each stage's steps from `--before` ms ahead of to `--after` ms
behind the largest prefills of `--stage` (a burst), so long steps and waits show where they happen.

    python scripts/step_trace_summary.py OUT/local/trace-server [--stage talker] [--bursts 3]
        [--clock OUT/clock.txt --row realtime]   (only the steps between that mark and the next:
                                                  scripts/gpu_load_trace.sh writes the marks)"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def load(trace_dir: Path) -> dict[str, list[dict]]:
    steps = {}
    for path in sorted(trace_dir.glob("*.jsonl")):
        steps[path.stem] = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return steps


def prefill_rows(step: dict) -> int:
    return max(0, (step["tokens"] or step["rows"]) - step["rows"])


def between(steps: dict[str, list[dict]], clock: Path, row: str) -> dict[str, list[dict]]:
    """The steps from `row`'s mark in `clock` ("name perf_counter" lines, in order) to the next mark."""
    marks = [line.split() for line in clock.read_text().splitlines() if line.strip()]
    i = next(k for k, (name, _) in enumerate(marks) if name == row)
    start, end = float(marks[i][1]), float(marks[i + 1][1]) if i + 1 < len(marks) else float("inf")
    return {name: [s for s in ss if start <= s["t"] < end] for name, ss in steps.items()}


def wall_stats(steps: list[dict]) -> str:
    if not steps:
        return "-"
    ms = sorted(s["ms"] for s in steps)
    p = lambda q: ms[min(len(ms) - 1, int(q * len(ms)))]  # noqa: E731
    return f"n {len(ms)} mean {statistics.fmean(ms):.1f} p50 {p(0.5):.1f} p90 {p(0.9):.1f} max {ms[-1]:.1f}"


def window(steps: dict[str, list[dict]], t0: float, before_ms: float, after_ms: float) -> list[str]:
    rows = [(s["t"], name, s) for name, ss in steps.items() for s in ss
            if t0 - before_ms / 1e3 <= s["t"] <= t0 + after_ms / 1e3]
    return [f"  {1e3 * (t - t0):+8.1f} ms  {name:9s} {s['ms']:7.1f} ms  rows {s['rows']:3d}  "
            f"extra {prefill_rows(s)}" for t, name, s in sorted(rows, key=lambda r: r[0])]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace_dir", type=Path)
    ap.add_argument("--stage", default="talker")
    ap.add_argument("--bursts", type=int, default=2)
    ap.add_argument("--before", type=float, default=50.0)
    ap.add_argument("--after", type=float, default=300.0)
    ap.add_argument("--clock", type=Path, default=None, help="marks between rows (with --row)")
    ap.add_argument("--row", default=None)
    args = ap.parse_args()
    steps = load(args.trace_dir)
    if args.clock is not None and args.row is not None:
        steps = between(steps, args.clock, args.row)
    for name, ss in steps.items():
        print(f"{name:9s} all: {wall_stats(ss)}")
        print(f"{'':9s} more input rows than rows: {wall_stats([s for s in ss if prefill_rows(s)])}")
    burst_steps = sorted(steps.get(args.stage, []), key=prefill_rows, reverse=True)
    for s in burst_steps[:args.bursts]:
        print(f"\n{args.stage} step with {prefill_rows(s)} prefill rows at t = {s['t']:.3f}:")
        print("\n".join(window(steps, s["t"], args.before, args.after)))


if __name__ == "__main__":
    main()
