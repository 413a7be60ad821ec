"""scripts/step_trace_summary.py on a hand-made two-stage trace: the step statistics, the burst window, and a
bench row's stalls grouped with the steps before them."""

import json
from pathlib import Path

from script_helpers import load_script


def _write(path: Path, steps: list[tuple[float, float, int, int]]) -> None:
    lines = [json.dumps({"t": t, "ms": ms, "rows": r, "tokens": n}) for t, ms, r, n in steps]
    path.write_text("".join(line + "\n" for line in lines))


def test_summary_and_burst_window(tmp_path, capsys, monkeypatch):
    _write(tmp_path / "talker.jsonl", [(10.0, 10.0, 4, 4), (10.02, 40.0, 6, 60), (10.07, 20.0, 6, 6)])
    _write(tmp_path / "thinker.jsonl", [(9.9, 5.0, 2, 2), (10.01, 8.0, 2, 300), (10.5, 5.0, 2, 2)])
    mod = load_script("step_trace_summary")
    steps = mod.load(tmp_path)
    assert [mod.prefill_rows(s) for s in steps["talker"]] == [0, 54, 0]
    assert mod.wall_stats(steps["talker"]) == "n 3 mean 23.3 p50 20.0 p90 40.0 max 40.0"
    assert mod.wall_stats([]) == "-"
    monkeypatch.setattr("sys.argv", ["x", str(tmp_path), "--bursts", "1", "--before", "15", "--after", "60"])
    mod.main()
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "talker    all: n 3 mean 23.3 p50 20.0 p90 40.0 max 40.0"
    assert "talker step with 54 prefill rows at t = 10.020:" in out
    window = out[out.index("talker step with 54 prefill rows at t = 10.020:") + 1:]
    assert [line.split()[0] for line in window] == ["-10.0", "+0.0", "+50.0"]  # not 10.5: past --after
    assert window[0].endswith("thinker       8.0 ms  rows   2  extra 298")


def test_a_row_between_two_clock_marks(tmp_path):
    _write(tmp_path / "talker.jsonl", [(10.0, 10.0, 4, 4), (10.02, 40.0, 6, 60), (10.07, 20.0, 6, 6)])
    _write(tmp_path / "thinker.jsonl", [(9.9, 5.0, 2, 2), (10.01, 8.0, 2, 300), (10.5, 5.0, 2, 2)])
    (tmp_path / "clock.txt").write_text("first 9.95\nsecond 10.05\nlast 10.5\n")
    mod = load_script("step_trace_summary")
    steps = mod.load(tmp_path)
    second = mod.between(steps, tmp_path / "clock.txt", "second")
    assert [s["t"] for s in second["talker"]] == [10.07] and second["thinker"] == []  # 10.5 is the next mark's
    last = mod.between(steps, tmp_path / "clock.txt", "last")
    assert [s["t"] for s in last["thinker"]] == [10.5] and last["talker"] == []


def test_stalls_grouped_with_the_steps_before_them(tmp_path, capsys, monkeypatch):
    _write(tmp_path / "talker.jsonl", [(10.0, 10.0, 4, 4), (10.02, 40.0, 6, 60), (10.07, 20.0, 6, 6)])
    _write(tmp_path / "thinker.jsonl", [(9.9, 5.0, 2, 2), (10.01, 8.0, 2, 300), (10.5, 5.0, 2, 2)])
    events = [[10.06, 12.0, 2], [10.07, 9.0, 2], [10.085, 40.0, 3], [10.5, 5.0, 1], [30.0, 1.0, 1]]
    (tmp_path / "results.json").write_text(json.dumps({"rows": [{"stall_events": events[:2]},
                                                                {"stall_events": events[2:]}, {}]}))
    mod = load_script("step_trace_summary")
    groups = mod.stall_groups(tmp_path / "results.json", 9.9, 20.0, 20.0)  # 30.0: outside the trace's span
    assert [len(g) for g in groups] == [3, 1] and groups[0][-1] == [10.085, 40.0, 3]
    monkeypatch.setattr("sys.argv", ["x", str(tmp_path), "--stalls", str(tmp_path / "results.json"),
                                     "--gap", "20", "--bursts", "1", "--before", "50", "--after", "5"])
    mod.main()
    out = capsys.readouterr().out.splitlines()
    assert "4 stalls in 2 groups; sizes [3, 1]" in out
    at = out.index("3 stalls from t = 10.060 over 25 ms, waits 9-40 ms, chunks [2, 3]:")
    assert [line.split()[0] for line in out[at + 1:]] == ["-50.0", "-40.0"]  # not +10.0: past --after


def test_rows_as_segments_with_their_longest_steps(tmp_path, capsys, monkeypatch):
    _write(tmp_path / "thinker.jsonl", [(1.0, 20.0, 2, 2), (1.1, 300.0, 4, 900), (1.5, 9.0, 4, 4),
                                        (5.0, 160.0, 3, 3), (5.2, 151.0, 3, 3)])
    monkeypatch.setattr("sys.argv", ["x", str(tmp_path), "--stage", "thinker", "--segments", "2", "--long", "150"])
    load_script("step_trace_summary").main()
    assert capsys.readouterr().out.splitlines() == [
        "t 1.0-1.5 s: 3 steps (5.9/s, 65% busy, 3.3 rows), longest ms [300, 20, 9], 1 over 150",  # 5.0: 3.5 s later
        "  with prefill rows: n 1 mean 300.0 p50 300.0 p90 300.0 max 300.0; "
        "without: n 2 mean 14.5 p50 20.0 p90 20.0 max 20.0",
        "t 5.0-5.2 s: 2 steps (5.7/s, 89% busy, 3.0 rows), longest ms [160, 151], 2 over 150",
        "  with prefill rows: -; without: n 2 mean 155.5 p50 160.0 p90 160.0 max 160.0"]
