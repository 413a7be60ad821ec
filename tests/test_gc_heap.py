"""The garbage collector in serving processes (omnistage/gc_heap.py): start-up's heap frozen out of collections
(in the serving process and in a pipeline's worker process), slow collections timed and logged."""

from __future__ import annotations

import gc
import logging
import re

import torch

from omnistage.gc_heap import PauseWatch, freeze_heap

pytest_plugins = ["serve_fixtures", "realtime_helpers"]


def test_freeze_heap_leaves_collections_only_what_came_after() -> None:
    torch.nn.Linear(4, 4)  # NOTE: what a process holds after start-up, here pytest's and torch's
    before = len(gc.get_objects())
    assert before > 10_000
    try:
        frozen = freeze_heap()
        assert frozen > 10_000 and len(gc.get_objects()) < before // 100  # NOTE: other threads may add a few
        later = [[i] for i in range(1000)]  # containers: tracked
        assert len(gc.get_objects()) >= 1000 and gc.get_freeze_count() == frozen
        del later
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0


def test_pause_watch_logs_slow_collections(caplog) -> None:
    watches = [PauseWatch("probe", threshold_s=0.0), PauseWatch("fast", threshold_s=60.0)]
    gc.callbacks.extend(watches)
    try:
        with caplog.at_level(logging.WARNING, logger="omnistage.gc_heap"):
            a, b = [], []
            a.append(b)
            b.append(a)  # NOTE: a cycle: only the collector frees it
            del a, b
            gc.collect()
    finally:
        for w in watches:
            gc.callbacks.remove(w)
    lines = [r.getMessage() for r in caplog.records]
    assert not [m for m in lines if m.startswith("fast:")]
    line = [m for m in lines if m.startswith("probe:")][-1]
    assert re.fullmatch(r"probe: a garbage collection of generation 2 took \d+ ms \(\d+ objects collected\)", line)
    assert int(re.search(r"\((\d+) objects", line).group(1)) >= 2


def frozen_count(log: str, process: str) -> int:
    match = re.search(rf"{process}: (\d+) start-up objects frozen out of garbage collection", log)
    assert match, f"no freeze logged by {process}"
    return int(match.group(1))


def test_serving_process_freezes_its_heap(server) -> None:
    assert frozen_count(server.log.read_text(), "serving process") > 100_000


def test_pipeline_worker_freezes_its_heap(rt_pipeline_server) -> None:
    log = rt_pipeline_server.log.read_text()
    assert frozen_count(log, "omnistage-pipeline0") > 100_000
    assert frozen_count(log, "serving process") > 100_000
