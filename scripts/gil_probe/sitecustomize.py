"""Stage-like threads inside any Python process started with this folder on PYTHONPATH (and GIL_PROBE=FILE):
each does PROBE_WORK loop iterations of Python, then sleeps PROBE_WAIT_MS (the GIL given up, as a stage thread
waiting for the GPU). Every 2 s a JSON line goes to FILE: steps per second of all PROBE_THREADS threads, and
how late they woke (ms: mean, p50, p90, p99): how long they waited for the GIL (and the OS) after each wait.

e.g. the server beside 64 idle realtime sessions (scripts/realtime_idle_cost.py):
  GIL_PROBE=/tmp/probe.jsonl PROBE_THREADS=3 PROBE_WORK=30000 PROBE_WAIT_MS=8 \\
  PYTHONPATH=scripts/gil_probe:src python -m omnistage.cli serve --port 8093
"""

import json
import os
import threading
import time

PATH = os.environ.get("GIL_PROBE")
THREADS = int(os.environ.get("PROBE_THREADS", "1"))
WORK = int(os.environ.get("PROBE_WORK", "3000"))
WAIT = float(os.environ.get("PROBE_WAIT_MS", "3")) / 1e3
_lock = threading.Lock()
_late: list[float] = []


def _stage() -> None:
    while True:
        x = 0
        for k in range(WORK):
            x += k
        t0 = time.perf_counter()
        time.sleep(WAIT)
        late = time.perf_counter() - t0 - WAIT
        with _lock:
            _late.append(late)


def _report() -> None:
    last = time.perf_counter()
    while True:
        time.sleep(2.0)
        now = time.perf_counter()
        with _lock:
            late = sorted(_late)
            _late.clear()
        if late:
            rec = {"steps_s": round(len(late) / (now - last), 1),
                   "late_ms_mean": round(1e3 * sum(late) / len(late), 3),
                   **{f"late_ms_p{q}": round(1e3 * late[len(late) * q // 100], 3) for q in (50, 90, 99)}}
            with open(PATH, "a") as f:
                f.write(json.dumps(rec) + "\n")
        last = now


if PATH:
    for i in range(THREADS):
        threading.Thread(target=_stage, daemon=True, name=f"gil-probe{i}").start()
    threading.Thread(target=_report, daemon=True, name="gil-probe-report").start()
