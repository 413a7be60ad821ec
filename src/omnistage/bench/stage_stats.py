"""Where the server's time goes during one bench row: the per-stage step counters of /metrics
(`omnistage_stage_{steps,busy_seconds,step_rows,graph_gpu_seconds,graph_replays}_total`) read before and
after the row."""

from __future__ import annotations

import re

_COUNTER = re.compile(r'^omnistage_stage_(steps|busy_seconds|step_rows|graph_gpu_seconds|graph_replays)_total'
                      r'\{stage="([^"]+)"\} (\S+)$', re.M)


def parse_stage_counters(text: str) -> dict[str, dict[str, float]]:
    """Prometheus text -> {stage: {"steps", "busy_seconds", "step_rows"[, "graph_gpu_seconds", "graph_replays"]}}."""
    out: dict[str, dict[str, float]] = {}
    for name, stage, value in _COUNTER.findall(text):
        out.setdefault(stage, {})[name] = float(value)
    return out


async def scrape_stage_counters(client) -> dict[str, dict[str, float]] | None:
    """GET /metrics through an httpx.AsyncClient; None when the server has no such counters."""
    try:
        r = await client.get("/metrics")
    except Exception:  # a server without /metrics (another implementation): no stage figures
        return None
    return parse_stage_counters(r.text) if r.status_code == 200 else None


def stage_summary(before: dict | None, after: dict | None, wall_s: float) -> dict[str, dict[str, float]] | None:
    """Per stage over a row of `wall_s` seconds: steps per second, mean step time (ms), busy fraction of
    the wall time (its worker inside a step), mean batch size; with CUDA graphs also the mean GPU time of a
    replay (ms) and the fraction of the wall time the stage's graphs ran on the GPU."""
    if not before or not after or wall_s <= 0:
        return None
    out = {}
    for stage, a in after.items():
        b = before.get(stage, {})
        steps = a.get("steps", 0) - b.get("steps", 0)
        busy = a.get("busy_seconds", 0) - b.get("busy_seconds", 0)
        rows = a.get("step_rows", 0) - b.get("step_rows", 0)
        out[stage] = {"steps_per_s": steps / wall_s, "mean_step_ms": busy / steps * 1e3 if steps else None,
                      "busy_fraction": busy / wall_s, "mean_batch": rows / steps if steps else None}
        if "graph_replays" in a:
            gpu = a["graph_gpu_seconds"] - b.get("graph_gpu_seconds", 0)
            replays = a["graph_replays"] - b.get("graph_replays", 0)
            out[stage].update(graph_ms=gpu / replays * 1e3 if replays else None, graph_gpu_fraction=gpu / wall_s)
    return out
