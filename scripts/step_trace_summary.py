"""Summarises a server's step trace (OMNISTAGE_STEP_TRACE=DIR, one DIR/<stage>.jsonl per stage): per stage
the steps' wall ms (mean, p50, p90, max) over all steps and over those with more input rows than batch rows
(prefills; code2wav's chunks of frames), then each stage's steps from `--before` ms ahead of to `--after` ms
behind the largest prefills of `--stage` (a burst), so long steps and waits show where they happen.

    python scripts/step_trace_summary.py OUT/local/trace-server [--stage talker] [--bursts 3]
        [--clock OUT/clock.txt --row realtime]   (only the steps between that mark and the next:
                                                  scripts/gpu_load_trace.sh writes the marks)
        [--stalls OUT/results.json]   (instead of bursts: the bench rows' stalls in the trace's time span, grouped
                                       where the audio ran out within --gap ms of the last; the steps before
                                       the largest groups; `cuda`: the allocator's allocations, frees, retries)
        [--segments 2 --long 150]     (instead: --stage's steps in segments split at pauses over 2 s, a bench
                                       row each; per segment steps a second, busy, mean rows, its longest steps,
                                       how many took over --long ms, and the steps with and without prefills)"""

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
            f"extra {prefill_rows(s)}" + (f"  cuda {s['cuda']}" if "cuda" in s else "")
            for t, name, s in sorted(rows, key=lambda r: r[0])]


def stall_groups(results: Path, start: float, end: float, gap_ms: float) -> list[list[list[float]]]:
    """The bench rows' `stall_events` between `start` and `end`, grouped where one began within `gap_ms` of the
    group's last, largest group first."""
    events = sorted(e for row in json.loads(results.read_text())["rows"] for e in row.get("stall_events", [])
                    if start <= e[0] <= end)
    groups: list[list[list[float]]] = []
    for e in events:
        if groups and e[0] - groups[-1][-1][0] <= gap_ms / 1e3:
            groups[-1].append(e)
        else:
            groups.append([e])
    return sorted(groups, key=len, reverse=True)


def print_stalls(steps: dict[str, list[dict]], args: argparse.Namespace) -> None:
    times = [s["t"] for ss in steps.values() for s in ss]
    groups = stall_groups(args.stalls, min(times), max(times) + 10, args.gap)
    print(f"\n{sum(map(len, groups))} stalls in {len(groups)} groups; sizes {[len(g) for g in groups][:20]}")
    for g in groups[:args.bursts]:
        waits = [e[1] for e in g]
        print(f"\n{len(g)} stalls from t = {g[0][0]:.3f} over {1e3 * (g[-1][0] - g[0][0]):.0f} ms, waits "
              f"{min(waits):.0f}-{max(waits):.0f} ms, chunks {sorted({e[2] for e in g})}:")
        print("\n".join(window(steps, g[0][0], args.before, args.after)))


def print_segments(steps: list[dict], pause_s: float, long_ms: float) -> None:
    segments: list[list[dict]] = []
    for s in steps:
        if not segments or s["t"] - segments[-1][-1]["t"] > pause_s:
            segments.append([])
        segments[-1].append(s)
    for seg in segments:
        ms = sorted((s["ms"] for s in seg), reverse=True)
        span = seg[-1]["t"] + seg[-1]["ms"] / 1e3 - seg[0]["t"]
        rows = statistics.fmean(s["rows"] for s in seg)
        print(f"t {seg[0]['t']:.1f}-{seg[-1]['t']:.1f} s: {len(seg)} steps ({len(seg) / span:.1f}/s, "
              f"{sum(ms) / 1e3 / span:.0%} busy, {rows:.1f} rows), longest ms {[round(m) for m in ms[:8]]}, "
              f"{sum(m > long_ms for m in ms)} over {long_ms:.0f}")
        print(f"  with prefill rows: {wall_stats([s for s in seg if prefill_rows(s)])}; "
              f"without: {wall_stats([s for s in seg if not prefill_rows(s)])}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace_dir", type=Path)
    ap.add_argument("--stage", default="talker")
    ap.add_argument("--bursts", type=int, default=2)
    ap.add_argument("--before", type=float, default=50.0)
    ap.add_argument("--after", type=float, default=300.0)
    ap.add_argument("--clock", type=Path, default=None, help="marks between rows (with --row)")
    ap.add_argument("--row", default=None)
    ap.add_argument("--stalls", type=Path, default=None, help="a bench results.json with stall_events")
    ap.add_argument("--gap", type=float, default=50.0)
    ap.add_argument("--segments", type=float, default=None, help="pause (s) between bench rows")
    ap.add_argument("--long", type=float, default=150.0)
    args = ap.parse_args()
    steps = load(args.trace_dir)
    if args.clock is not None and args.row is not None:
        steps = between(steps, args.clock, args.row)
    if args.segments is not None:
        print_segments(steps.get(args.stage, []), args.segments, args.long)
        return
    if args.stalls is not None:
        print_stalls(steps, args)
        return
    for name, ss in steps.items():
        print(f"{name:9s} all: {wall_stats(ss)}")
        print(f"{'':9s} more input rows than rows: {wall_stats([s for s in ss if prefill_rows(s)])}")
    burst_steps = sorted(steps.get(args.stage, []), key=prefill_rows, reverse=True)
    for s in burst_steps[:args.bursts]:
        print(f"\n{args.stage} step with {prefill_rows(s)} prefill rows at t = {s['t']:.3f}:")
        print("\n".join(window(steps, s["t"], args.before, args.after)))


if __name__ == "__main__":
    main()
