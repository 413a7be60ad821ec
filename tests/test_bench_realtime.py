"""`omnistage bench --realtime`: per-turn metric arithmetic on known timelines, the report's realtime table, and
the bench against the tiny server (spoken clips, server VAD, barge-in, idle sessions)."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from omnistage.bench.cli import add_bench_args, run_bench
from omnistage.bench.realtime import realtime_url, session_patch
from omnistage.bench.realtime_metrics import Turn, summarize_turns
from omnistage.bench.report import RESULTS, TABLE, markdown
from omnistage.bench.speech import speech_clip, speech_only, turn_clips
from omnistage.bench.stage_stats import SERVED_PHASES

pytest_plugins = ["serve_fixtures"]

PLAYED = Turn(speech_end=10.0, vad_stop=10.55, deltas=[(10.60, 4800), (10.70, 4800), (11.05, 2400)], done=11.1,
              status="completed")  # 0.2 + 0.2 s play until 11.00: the third delta stalls 50 ms
BARGED = Turn(speech_end=20.0, vad_stop=20.5, deltas=[(20.6, 24000), (20.7, 24000)], done=20.8, status="cancelled",
              barge_send=20.65)


def test_turn_metrics_from_known_timelines():
    assert PLAYED.stalls() == (1, pytest.approx(0.05))
    assert PLAYED.values() == {"speech_end_to_vad": [pytest.approx(0.55)],
                               "vad_to_first_audio": [pytest.approx(0.05)],
                               "speech_end_to_first_audio": [pytest.approx(0.6)], "rtf": [pytest.approx(1.0)],
                               "stall_s": [pytest.approx(0.05)], "stalls": [1]}
    assert BARGED.values()["barge_in_to_silence"] == [pytest.approx(0.05)] and "rtf" not in BARGED.values()
    early = Turn(speech_end=1.0, vad_stop=1.5, deltas=[(1.6, 100)], done=1.7, status="completed", barge_send=2.0)
    assert early.values()["barge_in_to_silence"] == [0.0]  # the answer was over before the barge-in


def test_turn_row_arithmetic():
    row = summarize_turns([PLAYED, BARGED, Turn(speech_end=30.0, error="timed out")], sessions=2,
                          clip="question_2s", turn_s=2.6, idle_sessions=64, start=9.0, end=31.0)
    assert {k: row[k] for k in ("workload", "concurrency", "num_turns", "failed", "barge_in_turns",
                                "barge_in_cancelled", "idle_sessions", "duration_s", "errors")} == {
        "workload": "realtime", "concurrency": 2, "num_turns": 2, "failed": 1, "barge_in_turns": 1,
        "barge_in_cancelled": 1, "idle_sessions": 64, "duration_s": 22.0, "errors": ["timed out"]}
    assert row["mean_audio_s"] == pytest.approx((0.5 + 2.0) / 2)
    assert row["mean_speech_end_to_vad_ms"] == pytest.approx(525.0)
    assert row["mean_vad_to_first_audio_ms"] == pytest.approx(75.0)
    assert row["p50_speech_end_to_first_audio_ms"] == pytest.approx(600.0)
    assert (row["mean_rtf"], row["mean_stall_ms"], row["mean_barge_in_to_silence_ms"]) == (
        pytest.approx(1.0), pytest.approx(50.0), pytest.approx(50.0))
    table = markdown({"meta": {"date": "d", "commit": "c", "device": "cpu", "gpus": 0, "workload": "realtime"},
                      "rows": [row | {"stagger_s": 10.0}]})
    assert "| question_2s | 2.6 | 2 | 10 | 64 | 2 | 1 | 525 | 75 | " in table


def test_session_settings():
    args = add_bench_args(argparse.ArgumentParser()).parse_args(["--random-weights", "--max-frames", "80"])
    patch = session_patch(args, ignore_eos=True)
    assert (patch["max_output_tokens"], patch["max_audio_frames"], patch["ignore_eos"]) == (24, 80, True)
    assert patch["audio"]["input"]["turn_detection"]["silence_duration_ms"] == 500
    assert "ignore_eos" not in session_patch(args, ignore_eos=False)
    assert realtime_url("http://h:1/", "m") == "ws://h:1/v1/realtime?model=m"


def test_realtime_bench_against_the_tiny_server(server, tmp_path):
    argv = ["--realtime", "--base-url", server.url, "--concurrency", "2", "--clips", "question_2s", "--turns", "2",
            "--barge-in-every", "2", "--idle-sessions", "2", "--random-weights", "--max-tokens", "4",
            "--max-frames", "40", "--warmup", "0", "--silence-ms", "300", "--output-dir", str(tmp_path)]
    assert run_bench(add_bench_args(argparse.ArgumentParser()).parse_args(argv)) == 0
    results = json.loads((tmp_path / RESULTS).read_text())
    assert results["meta"]["workload"] == "realtime"
    [row] = results["rows"]
    assert (row["concurrency"], row["num_turns"], row["failed"], row["extra_turns"], row["barge_in_turns"],
            row["barge_in_cancelled"]) == (2, 4, 0, 0, 2, 2)  # turn 2 starts while answer 1 plays: cancelled
    assert 0 <= row["mean_barge_in_to_silence_ms"] < 1000
    assert 0.3 - 0.032 <= row["mean_speech_end_to_vad_ms"] / 1e3 < 2.0  # the 300 ms of silence, less a window
    assert row["mean_vad_to_first_audio_ms"] > 0 and row["mean_rtf"] > 0
    assert row["turn_s"] == pytest.approx(37655 / 16000, abs=1e-3)  # the clip up to its last loud sample
    assert "| question_2s |" in (tmp_path / TABLE).read_text()
    phases = row["phases_ms"]  # the server's phase means over the row's answers (/metrics before and after)
    assert 0 < phases["first_token"] <= phases["first_frame"] <= phases["first_audio"]
    assert not set(SERVED_PHASES) & set(phases)  # a response's clock starts later than its request's arrival
    assert row["stages"]["thinker"]["steps_per_s"] > 0


def test_each_turn_speaks_its_own_variant_of_the_clip_unless_repeated() -> None:
    pcm = speech_only(speech_clip("question_2s"))
    clips = turn_clips(pcm, 3) + turn_clips(pcm, 3)  # two sessions' turns
    assert len({c.tobytes() for c in clips}) == 6 and all(c.shape == pcm.shape for c in clips)
    for c in clips:  # two samples a few LSB nearer zero: the same speech, the same end
        moved = np.flatnonzero(c != pcm)
        assert moved.size == 2 and np.all(np.abs(c[moved].astype(int)) < np.abs(pcm[moved].astype(int)))
        assert np.all(np.abs(c[moved].astype(int) - pcm[moved]) <= 64) and speech_only(c).size == pcm.size
    assert all(c is pcm for c in turn_clips(pcm, 2, repeat=True))
