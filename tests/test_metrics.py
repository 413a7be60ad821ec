from __future__ import annotations

from types import SimpleNamespace

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from omnistage.engine.cuda_graph import CUDAGraphs
from omnistage.pipeline.placement.stage_handle import worker_stats
from omnistage.server.errors import install_error_handlers
from omnistage.server.metrics import ServerMetrics, install_metrics
from omnistage.server.prometheus import CONTENT_TYPE, Counter, Histogram


def samples(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_histogram_buckets_are_cumulative_le():
    h = Histogram("lat_seconds", "Latency.", (0.1, 0.5, 1.0))
    for v in (0.05, 0.1, 0.3, 0.7, 2.0, 3.0):
        h.observe(v)
    assert h.render() == [
        "# HELP lat_seconds Latency.", "# TYPE lat_seconds histogram",
        'lat_seconds_bucket{le="0.1"} 2', 'lat_seconds_bucket{le="0.5"} 3', 'lat_seconds_bucket{le="1"} 4',
        'lat_seconds_bucket{le="+Inf"} 6', "lat_seconds_sum 6.15", "lat_seconds_count 6"]


def test_counter_labels_escape_and_check():
    c = Counter("req_total", "Requests.", ("endpoint", "status"))
    c.inc(endpoint='/a"b\\', status=200)
    c.inc(2, endpoint='/a"b\\', status=200)
    assert c.render()[-1] == 'req_total{endpoint="/a\\"b\\\\",status="200"} 3'
    with pytest.raises(ValueError, match="labels must be"):
        c.inc(endpoint="/a")
    with pytest.raises(ValueError, match="only goes up"):
        c.inc(-1, endpoint="/a", status=200)


def test_server_metrics_over_http():
    metrics = ServerMetrics()
    app = FastAPI()
    install_error_handlers(app)
    install_metrics(app, metrics)

    @app.get("/v1/models")
    async def models() -> dict:
        return {}

    @app.get("/v1/boom")
    async def boom() -> None:
        raise RuntimeError("x")

    client = TestClient(app, raise_server_exceptions=False)
    for path in ("/v1/models", "/v1/models", "/v1/missing/1", "/v1/missing/2", "/v1/boom"):
        client.get(path)
    metrics.observe_stage("talker", batch_size=12, queue_depth=3, kv_blocks_used=40, kv_blocks_total=100,
                          steps=50, busy_seconds=1.25, step_rows=600, graph_gpu_seconds=0.75, graph_replays=40,
                          graph_captures=24, kv_block_waits=7, kv_swaps=2)
    metrics.observe_finished(e2e=3.0, ttft=0.08, ttfp=0.3, audio_seconds=4.0, last_audio=2.0)
    r = client.get("/metrics")
    assert r.headers["content-type"] == CONTENT_TYPE
    s = samples(r.text)
    assert s['omnistage_requests_total{endpoint="/v1/models",status="200"}'] == 2
    assert s['omnistage_requests_total{endpoint="unmatched",status="404"}'] == 2
    assert s['omnistage_requests_total{endpoint="/v1/boom",status="500"}'] == 1
    assert s['omnistage_stage_batch_size{stage="talker"}'] == 12
    assert s['omnistage_stage_queue_depth{stage="talker"}'] == 3
    assert s['omnistage_kv_cache_blocks_in_use{stage="talker"}'] == 40
    assert s['omnistage_stage_steps_total{stage="talker"}'] == 50
    assert s['omnistage_stage_busy_seconds_total{stage="talker"}'] == 1.25
    assert s['omnistage_stage_step_rows_total{stage="talker"}'] == 600
    assert s['omnistage_stage_graph_gpu_seconds_total{stage="talker"}'] == 0.75
    assert s['omnistage_stage_graph_replays_total{stage="talker"}'] == 40
    assert s['omnistage_stage_graph_captures_total{stage="talker"}'] == 24
    assert s['omnistage_kv_block_waits_total{stage="talker"}'] == 7
    assert s['omnistage_kv_swaps_total{stage="talker"}'] == 2
    assert s['omnistage_audio_rtf_bucket{le="0.4"}'] == 0 and s['omnistage_audio_rtf_bucket{le="0.5"}'] == 1
    assert s["omnistage_audio_rtf_sum"] == 0.5
    assert s['omnistage_time_to_first_token_seconds_bucket{le="0.1"}'] == 1
    assert s['omnistage_time_to_first_token_seconds_bucket{le="0.05"}'] == 0
    assert s["omnistage_time_to_first_audio_seconds_count"] == 1
    assert s["omnistage_e2e_request_latency_seconds_sum"] == 3


def test_a_stage_with_graphs_reports_how_many_it_captured() -> None:
    """`omnistage_stage_graph_captures_total`: the bench's "captures" column (graphs captured during a row)."""
    graphs = CUDAGraphs()
    graphs.graphs.update({(b, 16): (None, None) for b in (1, 2, 4)})  # NOTE: what captures leave, without a GPU
    stage = SimpleNamespace(stats=dict, num_active=0, runner=SimpleNamespace(graphs=graphs))
    worker = SimpleNamespace(stage=stage, failed_requests=0, steps=5, busy_seconds=0.5, step_rows=9)
    assert worker_stats(worker)["graph_captures"] == 3 and worker_stats(worker)["graph_replays"] == 0
    stage.runner = SimpleNamespace()  # none: the CPU's stages
    assert "graph_captures" not in worker_stats(worker)

