"""OMNISTAGE_PROFILE_DIR: a stage worker writes its cProfile at stop, and a profiler that cannot start
(one per process from Python 3.12) never stops a stage."""

from __future__ import annotations

import cProfile
import pstats
import threading

import torch

from omnistage.pipeline.connector import Inbox
from omnistage.pipeline.faults import StepFaults
from omnistage.pipeline import worker
from omnistage.pipeline.worker import StageWorker


class CountingStage:
    def __init__(self) -> None:
        self.inbox, self.faults, self.step_requests, self.last_batch = Inbox(), StepFaults(), [], 1
        self.steps = 0
        self.stepped = threading.Event()

    def step(self) -> bool:
        self.steps += 1
        if self.steps >= 3:
            self.stepped.set()
        return self.steps < 50

    def abort(self, request_id: str) -> None:
        pass


def run_worker(name: str) -> tuple[StageWorker, CountingStage]:
    stage = CountingStage()
    errors: list = []
    w = StageWorker(name, stage, torch.device("cpu"), lambda *a: errors.append(a))
    w.start()
    assert stage.stepped.wait(10)
    w.stop()
    assert not errors
    return w, stage


def test_worker_writes_its_profile(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("OMNISTAGE_PROFILE_DIR", str(tmp_path))
    run_worker("talker")
    stats = pstats.Stats(str(tmp_path / "talker.prof"))
    assert any(func[2] == "step" for func in stats.stats)  # CountingStage.step was recorded


class BusyProfiler(cProfile.Profile):
    """What `enable` does from Python 3.12 when another profiler runs in the process."""

    def enable(self, *args, **kwargs) -> None:
        raise ValueError("Another profiling tool is already active")


def test_a_profiler_already_running_does_not_stop_the_stage(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("OMNISTAGE_PROFILE_DIR", str(tmp_path))
    monkeypatch.setattr(worker.cProfile, "Profile", BusyProfiler)
    _, stage = run_worker("code2wav")
    assert stage.steps >= 3 and not (tmp_path / "code2wav.prof").exists()
