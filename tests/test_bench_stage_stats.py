"""`omnistage bench`'s server-side figures of a row (bench/stage_stats.py): per-stage step counters, the request
phase means and the realtime responses started at pauses, each from /metrics text read before and after the row."""

from __future__ import annotations

import pytest

from omnistage.bench.stage_stats import (
    parse_phase_totals,
    parse_preemptive,
    parse_stage_counters,
    phase_means,
    row_server_stats,
    stage_summary,
)


def test_stage_summary_splits_gpu_time_from_step_time() -> None:
    text = "".join(f'omnistage_stage_{k}_total{{stage="{st}"}} {v}\n' for st, k, v in (
        ("talker", "steps", 110), ("talker", "busy_seconds", 3.0), ("talker", "step_rows", 1000),
        ("talker", "graph_gpu_seconds", 1.5), ("talker", "graph_replays", 100), ("talker", "graph_captures", 42),
        ("code2wav", "steps", 5)))
    text += 'omnistage_kv_block_waits_total{stage="talker"} 9\nomnistage_kv_swaps_total{stage="talker"} 3\n'
    before = {"talker": {"steps": 10, "busy_seconds": 1.0, "graph_gpu_seconds": 0.5, "graph_replays": 0,
                         "graph_captures": 41, "kv_block_waits": 2}}
    summary = stage_summary(before, parse_stage_counters(text), wall_s=2.0)
    assert summary["talker"] == pytest.approx({"steps_per_s": 50, "mean_step_ms": 20, "busy_fraction": 1.0,
                                               "mean_batch": 10, "graph_ms": 10, "graph_gpu_fraction": 0.5,
                                               "graph_captures": 1, "kv_block_waits": 7, "kv_swaps": 3})
    assert "graph_ms" not in summary["code2wav"] and "kv_block_waits" not in summary["code2wav"]


def test_a_rows_preemptive_responses_from_metrics_text() -> None:
    line = 'omnistage_realtime_preemptive_responses_total{{outcome="{}"}} {}\n'
    before = {"preemptive": parse_preemptive(line.format("used", 3.0))}
    after = {"preemptive": parse_preemptive(line.format("used", 7.0) + line.format("dropped", 2.0))}
    assert after["preemptive"] == {"used": 7.0, "dropped": 2.0}
    assert row_server_stats(before, after, 1.0)["preemptive"] == {"used": 4.0, "dropped": 2.0}
    assert "preemptive" not in row_server_stats(after, after, 1.0)  # none over the row: no field


def test_phase_means_from_metrics_text() -> None:
    def text(rows: list[tuple[str, float, int]]) -> str:
        return "".join(f'omnistage_request_phase_seconds_bucket{{phase="{p}",le="+Inf"}} {n}\n'
                       f'omnistage_request_phase_seconds_sum{{phase="{p}"}} {s}\n'
                       f'omnistage_request_phase_seconds_count{{phase="{p}"}} {n}\n' for p, s, n in rows)

    before = parse_phase_totals(text([("first_token", 1.0, 4), ("first_audio", 2.0, 2), ("first_frame", 7.0, 2)]))
    assert before["first_token"] == {"sum": 1.0, "count": 4} and set(before) == {"first_token", "first_audio",
                                                                                   "first_frame"}
    after = parse_phase_totals(text([("first_audio", 3.5, 5), ("first_token", 2.2, 8), ("thinker_start", 0.04, 4),
                                     ("first_frame", 7.0, 2)]))
    means = phase_means(before, after)
    assert list(means) == ["thinker_start", "first_token", "first_audio"]  # PHASES order; first_frame: no new
    assert means == pytest.approx({"thinker_start": 10.0, "first_token": 300.0, "first_audio": 500.0})
    assert phase_means(after, after) is None and phase_means(None, None) is None


def test_the_servers_first_token_and_audio_as_phases() -> None:
    def text(token: tuple[float, int], audio: tuple[float, int]) -> str:
        return "".join(f'omnistage_time_to_first_{w}_seconds_bucket{{le="+Inf"}} {n}\n'
                       f'omnistage_time_to_first_{w}_seconds_sum {s}\n'
                       f'omnistage_time_to_first_{w}_seconds_count {n}\n' for w, (s, n) in
                       (("token", token), ("audio", audio)))

    phase = 'omnistage_request_phase_seconds_sum{phase="first_audio"} 1.9\n' \
            'omnistage_request_phase_seconds_count{phase="first_audio"} 4\n'
    before = parse_phase_totals(text((0.5, 2), (0.8, 2)))
    assert before == {"served_token": {"sum": 0.5, "count": 2}, "served_audio": {"sum": 0.8, "count": 2}}
    means = phase_means(before, parse_phase_totals(text((0.9, 4), (1.6, 6)) + phase))
    assert list(means) == ["first_audio", "served_token", "served_audio"]  # the handler's after the engine's
    assert means == pytest.approx({"first_audio": 475.0, "served_token": 200.0, "served_audio": 200.0})
