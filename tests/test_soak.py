"""CI's soak: scripts/soak.py for 45 s at concurrency 16 (the documented run is 10 minutes:
docs/reliability.md). Every request ends as expected (completed, dropped, refused with its 4xx, or failed
alone by an injected fault), nothing is held once idle, and the server's RSS does not grow past the bound."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from serve_process import free_port

SOAK = Path(__file__).parents[1] / "scripts" / "soak.py"


def test_soak_45s(tmp_path, tiny_dir):  # tiny_dir: the checkpoint exists before the server looks for it
    out = tmp_path / "soak.json"
    args = ["--duration", "45", "--concurrency", "16", "--sample-every", "2", "--port", str(free_port())]
    run = subprocess.run([sys.executable, str(SOAK), *args, "--out", str(out)], capture_output=True,
                         text=True, timeout=300)
    assert out.exists(), run.stdout + run.stderr
    summary = json.loads(out.read_text())
    assert not summary["unexpected"], summary["unexpected"]
    assert summary["rss_mb"]["growth"] <= 200, summary["rss_mb"]  # the script's --max-rss-growth-mb
    assert run.returncode == 0, {k: summary[k] for k in ("kv_in_use_idle", "active_idle")}
    outcomes = summary["outcomes"]
    for kind in ("stream", "text", "speech", "drop", "bad", "fault"):
        assert outcomes.get(f"{kind} ok", 0) > 0, outcomes
    assert summary["requests"] == sum(outcomes.values()) >= 50
    assert not any(summary["kv_in_use_idle"].values()) and not any(summary["active_idle"].values())
    assert summary["kv_in_use_peak"]["thinker"] > 0 and summary["kv_in_use_peak"]["talker"] > 0
