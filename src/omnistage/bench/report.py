"""Results of a run: one JSON ({"meta", "rows"}) that every backend of the run adds its rows to, and the
markdown table made from it (the PNG plots: bench/figures.py, bench/ablation.py)."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
from collections.abc import Callable
from pathlib import Path

from omnistage.bench.ablation import plot_ablation
from omnistage.bench.figures import plot
from omnistage.bench.realtime_metrics import is_realtime
from omnistage.bench.stage_stats import PHASES, SERVED_PHASES

RESULTS = "results.json"
TABLE = "results.md"
# markdown column -> (row key, format)
COLUMNS = {"backend": ("backend", "{}"), "variant": ("variant", "{}"), "workload": ("workload", "{}"),
           "media": ("media", "{}"), "P": ("prompt_tokens", "{}"),
           "server P": ("mean_server_prompt_tokens", "{:.0f}"),
           "c": ("concurrency", "{}"), "n": ("num_requests", "{}"), "req/s": ("request_throughput", "{:.3f}"),
           "audio s/s": ("audio_throughput", "{:.2f}"), "TTFT ms": ("mean_ttft_ms", "{:.0f}"),
           "TTFP ms": ("mean_ttfp_ms", "{:.0f}"), "TTFP p50": ("p50_ttfp_ms", "{:.0f}"),
           "TTFP p90": ("p90_ttfp_ms", "{:.0f}"), "TTFP p99": ("p99_ttfp_ms", "{:.0f}"),
           "TTFP 1st": ("first_ttfp_ms", "{:.0f}"), "RTF": ("mean_rtf", "{:.3f}"),
           "RTF p90": ("p90_rtf", "{:.3f}"),
           "stalled": ("stalled_streams", "{}"), "stall s": ("stall_s", "{:.3f}"),
           "max stall ms": ("max_stall_ms", "{:.0f}"), "E2E ms": ("mean_e2e_ms", "{:.0f}"),
           "E2E p90": ("p90_e2e_ms", "{:.0f}"), "ICG p90 ms": ("p90_icg_ms", "{:.0f}")}
# the realtime table: column -> (row key, format)
REALTIME_COLUMNS = {"variant": ("variant", "{}"), "clip": ("clip", "{}"), "turn s": ("turn_s", "{:.1f}"),
                    "sessions": ("concurrency", "{}"), "stagger s": ("stagger_s", "{:.0f}"),
                    "idle": ("idle_sessions", "{}"), "turns": ("num_turns", "{}"), "failed": ("failed", "{}"),
                    "end -> VAD ms": ("mean_speech_end_to_vad_ms", "{:.0f}"),
                    "VAD -> audio ms": ("mean_vad_to_first_audio_ms", "{:.0f}"),
                    "VAD -> audio p90": ("p90_vad_to_first_audio_ms", "{:.0f}"),
                    "end -> audio ms": ("mean_speech_end_to_first_audio_ms", "{:.0f}"),
                    "RTF": ("mean_rtf", "{:.3f}"), "stalls": ("mean_stalls", "{:.2f}"),
                    "stall ms": ("mean_stall_ms", "{:.0f}"), "barge-ins": ("barge_in_turns", "{}"),
                    "cancelled": ("barge_in_cancelled", "{}"),
                    "barge-in -> silence ms": ("mean_barge_in_to_silence_ms", "{:.0f}"),
                    "p90": ("p90_barge_in_to_silence_ms", "{:.0f}")}
# the stage table's cells after the stage name: (stage figure, format)
STAGE_CELLS = (("steps_per_s", "{:.1f}"), ("mean_step_ms", "{:.1f}"), ("busy_fraction", "{:.0%}"),
               ("mean_batch", "{:.1f}"), ("graph_ms", "{:.1f}"), ("graph_gpu_fraction", "{:.0%}"),
               ("graph_captures", "{:.0f}"), ("kv_block_waits", "{:.0f}"), ("kv_swaps", "{:.0f}"))


def git_commit() -> str:
    """$OMNISTAGE_COMMIT (for copies without .git), else `git rev-parse HEAD` (+ "-dirty"), else "unknown"."""
    if os.environ.get("OMNISTAGE_COMMIT"):
        return os.environ["OMNISTAGE_COMMIT"]
    try:
        here = Path(__file__).parent
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "-uno"], cwd=here, capture_output=True, text=True,
                               check=False)
        return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def device_info() -> tuple[str, int]:
    """(name of this machine's accelerator, count); the CPU's name and 0 without one."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0), torch.cuda.device_count()
    cpuinfo = Path("/proc/cpuinfo")
    names = [ln.split(":", 1)[1].strip() for ln in cpuinfo.read_text().splitlines()
             if ln.startswith("model name")] if cpuinfo.exists() else []
    return names[0] if names else platform.processor() or platform.machine(), 0


def run_meta(command: str, workload: str, **extra: object) -> dict:
    import torch
    import transformers

    name, gpus = device_info()
    return {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "commit": git_commit(), "device": name, "gpus": gpus, "workload": workload, "command": command,
            "torch": torch.__version__, "transformers": transformers.__version__, **extra}


def add_results(out_dir: str | Path, meta: dict, rows: list[dict]) -> dict:
    """Append `rows` to out_dir/results.json (made with `meta` when new; later runs go under meta.runs)."""
    path = Path(out_dir) / RESULTS
    path.parent.mkdir(parents=True, exist_ok=True)
    results = json.loads(path.read_text()) if path.exists() else {"meta": {**meta, "runs": []}, "rows": []}
    results["meta"]["runs"].append(meta)
    results["rows"].extend(rows)
    path.write_text(json.dumps(results, indent=2) + "\n")
    return results


def _cell(row: dict, key: str, fmt: str) -> str:
    value = row.get(key)
    return "-" if value is None else fmt.format(value)


def _row_key(row: dict) -> tuple:
    """Rows in order: backend, variant, workload, media, prompt length, concurrency."""
    return (row["backend"], row.get("variant") or "", row.get("workload") or "", row.get("media") or "",
            row["prompt_tokens"], row["concurrency"])


def markdown(results: dict) -> str:
    meta = results["meta"]
    chat = [r for r in results["rows"] if not is_realtime(r)]
    lines = [(f"Run {meta['date']}, commit `{meta['commit']}`, {meta['device']} x {meta['gpus']}, "
              f"workload {meta['workload']}."), ""]
    lines += [f"- `{run['command']}`" for run in meta.get("runs", [])] + [""]
    lines += ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in sorted(chat, key=_row_key):
        lines.append("| " + " | ".join(_cell(row, k, f) for k, f in COLUMNS.values()) + " |")
    lines += ["", ("Times in ms, RTF = last audio chunk / audio seconds; P = tokens of the message texts, "
                   "server P = the server's prompt tokens (media included); TTFP 1st = the first request's; "
                   "stalled = streams whose playback (from the first chunk, in real time) ran dry, stall s = "
                   "their total wait, max stall = the longest one stream's; for `hf` (no streaming) the "
                   "concurrency is its batch size and TTFT = TTFP = E2E.")]
    return "\n".join(lines + _stage_lines(chat) + _phase_lines(chat) + _realtime_lines(results["rows"])) + "\n"


def _realtime_lines(rows: list[dict]) -> list[str]:
    """The realtime rows (bench/realtime_metrics.py says what each time is)."""
    rows = sorted((r for r in rows if is_realtime(r)),
                  key=lambda r: (r.get("variant") or "", r["clip"], r["idle_sessions"], r["concurrency"],
                                 r.get("stagger_s", 0)))
    if not rows:
        return []
    lines = ["", "Realtime sessions (per turn; end = the speech's last append sent, VAD = speech_stopped received, "
             "audio = first output_audio.delta; RTF and stalls of answers played from their first delta):", "",
             "| " + " | ".join(REALTIME_COLUMNS) + " |", "|" + "---|" * len(REALTIME_COLUMNS)]
    return lines + ["| " + " | ".join(_cell(r, k, f) for k, f in REALTIME_COLUMNS.values()) + " |" for r in rows]


def _server_table(rows: list[dict], key: str, columns: list[str], lines_of: Callable[[dict], list[list[str]]],
                  caption: str) -> list[str]:
    """A table of the rows that have server figures under `key` (omnistage: /metrics before and after the
    row): variant, workload (and media), P, c, then `columns`, one line per cell list `lines_of(row[key])`
    gives."""
    names = ["variant", "workload", "P", "c", *columns]
    lines = ["| " + " | ".join(names) + " |", "|---" * len(names) + "|"]
    for row in sorted((r for r in rows if r.get(key)), key=_row_key):
        workload = " ".join(filter(None, (row.get("workload"), row.get("media"))))
        head = f"| {row.get('variant') or ''} | {workload} | {row['prompt_tokens']} | {row['concurrency']} | "
        lines += [head + " | ".join(cells) + " |" for cells in lines_of(row[key])]
    return ["", caption, "", *lines] if len(lines) > 2 else []


def _stage_lines(rows: list[dict]) -> list[str]:
    """Per-stage step figures of the rows that have them."""
    return _server_table(
        rows, "stages", ["stage", "steps/s", "mean step ms", "busy", "mean batch", "graph GPU ms", "graph GPU busy",
                         "captures", "KV waits", "KV swaps"],
        lambda stages: [[stage, *(_cell(s, k, f) for k, f in STAGE_CELLS)] for stage, s in sorted(stages.items())],
        "Where the time goes (server step counters over each row; busy = the stage's worker inside a step; "
        "graph GPU = its CUDA graph replays on the GPU, timed by events; captures: graphs captured during the row, "
        "each a pause of every stage; KV waits / swaps: grants of KV blocks refused, requests swapped out, each a "
        "pause in its stream):")


def _phase_lines(rows: list[dict]) -> list[str]:
    """Mean phase times of the rows that have them, in the phases some row reached (a realtime turn's too)."""
    cols = [k for k in PHASES + SERVED_PHASES if any(k in (r.get("phases_ms") or {}) for r in rows)]
    return _server_table(rows, "phases_ms", cols, lambda p: [[_cell(p, k, "{:.0f}") for k in cols]],
                         "TTFP's parts (server side: mean ms from the server's engine client taking the request to the "
                         "first time it reached each phase, over the row's finished requests; served_token / "
                         "served_audio: its HTTP handler took the first text / audio delta):")


def write_report(out_dir: str | Path) -> list[Path]:
    """results.md and the plots, from out_dir/results.json."""
    results = json.loads((Path(out_dir) / RESULTS).read_text())
    table = Path(out_dir) / TABLE
    table.write_text(markdown(results))
    return [table, *plot(results, out_dir), *plot_ablation(results, out_dir)]
