"""Where the server's time goes during one bench row: the per-stage step counters of /metrics
(`omnistage_stage_{steps,busy_seconds,step_rows,graph_gpu_seconds,graph_replays,graph_captures}_total`,
`omnistage_kv_block_waits_total`, `omnistage_kv_swaps_total`), the request phase histogram
(`omnistage_request_phase_seconds_{sum,count}`) and the server's first-token and first-audio histograms
(`omnistage_time_to_first_{token,audio}_seconds_{sum,count}`, as the phases served_token and served_audio: the HTTP
handler took the first text / audio delta) read before and after the row."""

from __future__ import annotations

import re

_COUNTER = re.compile(r'^omnistage_(?:stage_)?(steps|busy_seconds|step_rows|graph_gpu_seconds|graph_replays|'
                      r'graph_captures|kv_block_waits|kv_swaps)_total\{stage="([^"]+)"\} (\S+)$', re.M)
_PHASE = re.compile(r'^omnistage_request_phase_seconds_(sum|count)\{phase="([^"]+)"\} (\S+)$', re.M)
_SERVED = re.compile(r'^omnistage_time_to_first_(token|audio)_seconds_(sum|count) (\S+)$', re.M)
_PREEMPT = re.compile(r'^omnistage_realtime_preemptive_responses_total\{outcome="([^"]+)"\} (\S+)$', re.M)
# the engine's marks (engine/request.py), in the order a text + audio request reaches them; a realtime turn's
# open request also reaches REALTIME_PHASES (between thinker_start and first_token)
PHASES = ("prompt_start", "prompt", "encoded", "thinker_start", "turn_end", "close", "closed", "first_token",
          "talker_start", "first_frame", "code2wav_start", "first_audio")
# where the server's HTTP handler took the first text / audio delta (from the handler's start, just before the
# engine's arrival): after first_token / first_audio by the way from a stage's thread to the server's event loop
SERVED_PHASES = ("served_token", "served_audio")
REALTIME_PHASES = ("turn_end", "close", "closed")


def parse_stage_counters(text: str) -> dict[str, dict[str, float]]:
    """Prometheus text -> {stage: {"steps", "busy_seconds", "step_rows"[, "graph_gpu_seconds", "graph_replays",
    "graph_captures", "kv_block_waits", "kv_swaps"]}}."""
    out: dict[str, dict[str, float]] = {}
    for name, stage, value in _COUNTER.findall(text):
        out.setdefault(stage, {})[name] = float(value)
    return out


def parse_phase_totals(text: str) -> dict[str, dict[str, float]]:
    """Prometheus text -> {phase: {"sum": seconds, "count": requests}} of the request phase histogram and, as
    `SERVED_PHASES`, of the server's first-token and first-audio histograms."""
    out: dict[str, dict[str, float]] = {}
    for name, phase, value in _PHASE.findall(text):
        out.setdefault(phase, {})[name] = float(value)
    for what, name, value in _SERVED.findall(text):
        out.setdefault(f"served_{what}", {})[name] = float(value)
    return out


def parse_preemptive(text: str) -> dict[str, float]:
    """Prometheus text -> {outcome: count} of realtime responses started at pauses ("used", "dropped")."""
    return {outcome: float(v) for outcome, v in _PREEMPT.findall(text)}


async def scrape_server_counters(client) -> dict[str, dict[str, dict[str, float]]] | None:
    """GET /metrics through an httpx.AsyncClient -> {"stages": ..., "phases": ...} (the two parsers above);
    None when the server has no /metrics."""
    try:
        r = await client.get("/metrics")
    except Exception:  # a server without /metrics (another implementation): no stage figures
        return None
    if r.status_code != 200:
        return None
    return {"stages": parse_stage_counters(r.text), "phases": parse_phase_totals(r.text),
            "preemptive": parse_preemptive(r.text)}


def row_server_stats(before: dict | None, after: dict | None, wall_s: float, served: bool = True
                     ) -> dict[str, dict | None]:
    """A row's "stages" (`stage_summary`), "phases_ms" (`phase_means`; `served`: with `SERVED_PHASES`, which a
    realtime row leaves out: its responses' clocks start at the response, not at the request's arrival) and,
    where realtime responses were started at pauses, "preemptive" ({"used", "dropped"} over the row) from
    scrapes before and after it."""
    b, a = before or {}, after or {}
    phases = phase_means(b.get("phases"), a.get("phases"))
    if phases and not served:
        phases = {k: v for k, v in phases.items() if k not in SERVED_PHASES} or None
    out = {"stages": stage_summary(b.get("stages"), a.get("stages"), wall_s), "phases_ms": phases}
    moved = {k: v - b.get("preemptive", {}).get(k, 0.0) for k, v in a.get("preemptive", {}).items()}
    if any(moved.values()):
        out["preemptive"] = {k: moved.get(k, 0.0) for k in ("used", "dropped")}
    return out


def phase_means(before: dict | None, after: dict | None) -> dict[str, float] | None:
    """{phase: mean ms from engine arrival} over the requests that finished between the scrapes, in `PHASES`
    order (others after); None when none reached a phase."""
    if after is None:
        return None
    out = {}
    order = PHASES + SERVED_PHASES
    for phase in sorted(after, key=lambda p: order.index(p) if p in order else len(order)):
        b = (before or {}).get(phase, {})
        n = after[phase].get("count", 0) - b.get("count", 0)
        if n > 0:
            out[phase] = (after[phase]["sum"] - b.get("sum", 0)) / n * 1e3
    return out or None


def stage_summary(before: dict | None, after: dict | None, wall_s: float) -> dict[str, dict[str, float]] | None:
    """Per stage over a row of `wall_s` seconds: steps per second, mean step time (ms), busy fraction of
    the wall time (its worker inside a step), mean batch size; with CUDA graphs also the mean GPU time of a
    replay (ms), the fraction of the wall time the stage's graphs ran on the GPU and the graphs captured over the
    row (`graph_captures`, each a pause of every stage); where the stage grants KV as
    requests grow, the grants it refused and the requests it swapped out over the row (`kv_block_waits`,
    `kv_swaps`)."""
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
        for key in ("graph_captures", "kv_block_waits", "kv_swaps"):
            if key in a:
                out[stage][key] = a[key] - b.get(key, 0)
    return out
