"""The server's metrics (Prometheus text through `server.prometheus`).

RTF here is (last audio chunk - arrival) / audio seconds: below 1 is faster than real time.
`process_resident_memory_bytes` is read from /proc at scrape time (Linux; absent elsewhere).
"""

from __future__ import annotations

import os
from collections.abc import Callable

from fastapi import FastAPI
from fastapi.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from omnistage.server.prometheus import CONTENT_TYPE, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 60.0)
RTF_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0, 1.5, 2.0, 5.0)


STAGE_COUNTERS = {  # totals a stage's stats may carry besides the common ones
    "kv_block_waits": "KV block grants refused: the request waited a step (engine/kv_growth.py).",
    "kv_swaps": "Requests swapped out to host memory when KV blocks ran out (engine/kv_growth.py).",
    "prefix_cache_queries": "Prompt tokens looked up in the prefix cache (as vLLM's).",
    "prefix_cache_hits": "Prompt tokens found there (not prefilled again).",
    "encoder_cache_queries": "Media items looked up in the encoder cache.",
    "encoder_cache_hits": "Media items found there (not encoded again)."}


class ServerMetrics:
    """The metrics the server and the stages update; `render()` is the /metrics body."""

    def __init__(self, prefix: str = "omnistage") -> None:
        p = prefix
        self.requests = Counter(f"{p}_requests_total", "HTTP requests by endpoint and status code.",
                                ("endpoint", "status"))
        self.ttft = Histogram(f"{p}_time_to_first_token_seconds", "Arrival to first text token.",
                              LATENCY_BUCKETS)
        self.ttfp = Histogram(f"{p}_time_to_first_audio_seconds", "Arrival to first audio chunk.",
                              LATENCY_BUCKETS)
        self.rtf = Histogram(f"{p}_audio_rtf", "(Last audio chunk - arrival) / audio seconds.", RTF_BUCKETS)
        self.e2e = Histogram(f"{p}_e2e_request_latency_seconds", "Arrival to finish.", LATENCY_BUCKETS)
        self.phase = Histogram(f"{p}_request_phase_seconds",
                               "Engine arrival to the first time the request reached each phase.", LATENCY_BUCKETS,
                               ("phase",))
        self.batch_size = Gauge(f"{p}_stage_batch_size", "Requests in the stage's last step.", ("stage",))
        self.queue_depth = Gauge(f"{p}_stage_queue_depth", "Requests waiting for the stage.", ("stage",))
        self.kv_blocks_used = Gauge(f"{p}_kv_cache_blocks_in_use", "KV cache blocks in use.", ("stage",))
        self.kv_blocks_total = Gauge(f"{p}_kv_cache_blocks_total", "KV cache blocks allocated.", ("stage",))
        self.active = Gauge(f"{p}_stage_requests_active", "Requests the stage holds.", ("stage",))
        self.failed = Counter(f"{p}_stage_requests_failed_total", "Requests failed by a fault in the stage.",
                              ("stage",))
        self.steps = Counter(f"{p}_stage_steps_total", "Steps that ran rows (a batch of requests).",
                             ("stage",))
        self.busy = Counter(f"{p}_stage_busy_seconds_total",
                            "Wall time of the steps that did work (ran rows or completed earlier ones).",
                            ("stage",))
        self.step_rows = Counter(f"{p}_stage_step_rows_total", "Requests in those steps, summed.", ("stage",))
        self.graph_gpu = Counter(f"{p}_stage_graph_gpu_seconds_total",
                                 "GPU time of the stage's CUDA graph replays (events around each).", ("stage",))
        self.graph_replays = Counter(f"{p}_stage_graph_replays_total", "CUDA graph replays timed.", ("stage",))
        self.graph_captures = Counter(f"{p}_stage_graph_captures_total",
                                      "CUDA graphs captured, at start and later (each later one a pause).",
                                      ("stage",))
        self.restarts = Counter(f"{p}_stage_restarts_total",
                                "Times the replica's process died and was started again.", ("stage",))
        self.counters = {k: Counter(f"{p}_{k}_total", h, ("stage",)) for k, h in STAGE_COUNTERS.items()}
        self.waiting = Gauge(f"{p}_requests_waiting", "Admitted requests without all their first outputs.")
        self.waiting_tokens = Gauge(f"{p}_requests_waiting_prompt_tokens", "Their prompt tokens.")
        self.realtime_streamed_rows = Counter(
            f"{p}_realtime_streamed_prompt_rows_total",
            "Prompt rows of realtime spoken turns (their audio's encoder windows) prefilled while spoken.")
        self.realtime_prepared_turns = Counter(
            f"{p}_realtime_prepared_turns_total",
            "Realtime spoken turns whose whole prompt was prefilled where the user paused, before the turn ended.")
        self.realtime_preempted = Counter(f"{p}_realtime_preemptive_responses_total",
                                          "Responses started where the user paused: used, or dropped (spoke on).",
                                          ("outcome",))
        self.rss = Gauge("process_resident_memory_bytes", "Resident memory of the server process.")
        self._all = [self.requests, self.ttft, self.ttfp, self.rtf, self.e2e, self.phase, self.batch_size,
                     self.queue_depth, self.kv_blocks_used, self.kv_blocks_total, self.active, self.failed,
                     self.steps, self.busy, self.step_rows, self.graph_gpu, self.graph_replays, self.graph_captures,
                     self.restarts, self.waiting,
                     self.waiting_tokens, self.realtime_streamed_rows, self.realtime_prepared_turns,
                     self.realtime_preempted, self.rss,
                     *self.counters.values()]

    def observe_stage(self, stage: str, batch_size: int, queue_depth: int, kv_blocks_used: int | None = None,
                      kv_blocks_total: int | None = None, active: int | None = None,
                      failed: int | None = None, steps: int | None = None, busy_seconds: float | None = None,
                      step_rows: int | None = None, graph_gpu_seconds: float | None = None,
                      graph_replays: int | None = None, graph_captures: int | None = None,
                      restarts: int | None = None, **counters: int) -> None:
        """`counters`: the stage's own totals (`STAGE_COUNTERS`)."""
        self.batch_size.set(batch_size, stage=stage)
        self.queue_depth.set(queue_depth, stage=stage)
        if kv_blocks_used is not None:
            self.kv_blocks_used.set(kv_blocks_used, stage=stage)
        if kv_blocks_total is not None:
            self.kv_blocks_total.set(kv_blocks_total, stage=stage)
        if active is not None:
            self.active.set(active, stage=stage)
        for counter, total in ((self.failed, failed), (self.steps, steps), (self.busy, busy_seconds),
                               (self.step_rows, step_rows), (self.graph_gpu, graph_gpu_seconds),
                               (self.graph_replays, graph_replays), (self.graph_captures, graph_captures),
                               (self.restarts, restarts),
                               *((self.counters[k], v) for k, v in counters.items())):
            if total is not None:
                counter.set_total(total, stage=stage)

    def observe_finished(self, e2e: float, ttft: float | None = None, ttfp: float | None = None,
                         audio_seconds: float = 0.0, last_audio: float | None = None,
                         phases: dict[str, float] | None = None) -> None:
        """Times in seconds since the request arrived; `last_audio` = time of the last audio chunk; `phases`:
        seconds from the engine's arrival to each phase the request reached."""
        self.e2e.observe(e2e)
        for phase, seconds in (phases or {}).items():
            self.phase.observe(seconds, phase=phase)
        if ttft is not None:
            self.ttft.observe(ttft)
        if ttfp is not None:
            self.ttfp.observe(ttfp)
        if audio_seconds > 0 and last_audio is not None:
            self.rtf.observe(last_audio / audio_seconds)

    def render(self) -> str:
        return "\n".join(line for m in self._all for line in m.render()) + "\n"


def install_metrics(app: FastAPI, metrics: ServerMetrics,
                    stage_stats: Callable[[], dict[str, dict[str, int]]] | None = None,
                    admission: object | None = None) -> None:
    """Count every HTTP request by route and status, and serve GET /metrics (with the engine's
    per-stage gauges read from `stage_stats`, and the waiting requests and tokens from `admission`'s
    `requests` and `tokens`, at scrape time)."""
    app.add_middleware(_CountRequests, metrics=metrics)

    @app.get("/metrics", include_in_schema=False)
    async def _metrics() -> Response:
        for stage, s in (stage_stats() if stage_stats is not None else {}).items():
            metrics.observe_stage(stage, **s)
        if admission is not None:
            metrics.waiting.set(admission.requests)
            metrics.waiting_tokens.set(admission.tokens)
        if (rss := rss_bytes()) is not None:
            metrics.rss.set(rss)
        return Response(metrics.render(), media_type=CONTENT_TYPE)


def rss_bytes(pid: int | str = "self") -> int | None:
    """Resident memory of a process from /proc (None where there is no /proc)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return None


class _CountRequests:
    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            # NOTE: the route template, not the raw path, so unknown URLs cannot blow up the label set.
            route = getattr(scope.get("route"), "path", "unmatched")
            self.metrics.requests.inc(endpoint=route, status=status)
