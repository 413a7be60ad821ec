"""OMNISTAGE_PROFILE_DIR: a stage worker writes its cProfile at stop, and a profiler that cannot start
(one per process from Python 3.12) never stops a stage. OMNISTAGE_STEP_TRACE: one JSON line per step."""

from __future__ import annotations

import cProfile
import json
import pstats
import threading

import pytest
import torch

from omnistage.config_loader import default_deploy_config, load_deploy_config
from omnistage.entrypoints.omni import Omni
from omnistage.models.qwen3_omni.make_tiny import tiny_checkpoint
from omnistage.pipeline import worker
from omnistage.pipeline.connector import Inbox
from omnistage.pipeline.faults import StepFaults
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


def run_worker(name: str, device: str = "cpu") -> tuple[StageWorker, CountingStage]:
    stage = CountingStage()
    errors: list = []
    w = StageWorker(name, stage, torch.device(device), lambda *a: errors.append(a))
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


def trace(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_worker_traces_each_step_that_ran_rows(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("OMNISTAGE_STEP_TRACE", str(tmp_path))
    _, stage = run_worker("thinker")
    lines = trace(tmp_path / "thinker.jsonl")
    assert len(lines) == min(stage.steps, 49)  # step 50 on ran nothing
    assert all(x["rows"] == 1 and x["tokens"] is None and x["ms"] >= 0 and "cuda" not in x for x in lines)
    assert [x["t"] for x in lines] == sorted(x["t"] for x in lines)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")
def test_a_cuda_worker_traces_the_allocator_s_totals(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("OMNISTAGE_STEP_TRACE", str(tmp_path))
    before = torch.cuda.memory_stats(0).get("num_device_alloc", 0)
    run_worker("code2wav", "cuda:0")
    totals = [x["cuda"] for x in trace(tmp_path / "code2wav.jsonl")]
    assert totals and all(len(t) == 3 and t[0] >= before for t in totals)
    assert totals == sorted(totals)  # running totals


def test_step_trace_counts_each_stage_s_new_rows(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("OMNISTAGE_STEP_TRACE", str(tmp_path))
    d = tiny_checkpoint("tiny")
    o = Omni(d, deploy=load_deploy_config(default_deploy_config(d), platform="cpu"), device="cpu")
    try:
        req = o.engine.make_request("r", [{"role": "user", "content": "Say hello."}], None, want_audio=True,
                                    voice=None, sampling={"temperature": 0, "max_tokens": 5, "ignore_eos": True},
                                    talker_sampling={"max_frames": 6, "ignore_eos": True}, emit=lambda d: None)
        o.engine.add_request(req)
        o.engine.wait([req.request_id])
    finally:
        o.engine.shutdown()
    thinker, talker, code2wav = (trace(tmp_path / f"{n}.jsonl") for n in ("thinker", "talker", "code2wav"))
    # the prompt in one step, then one token a step; the talker's prompt rows, then one row a frame
    assert [x["tokens"] for x in thinker] == [len(req.prompt.input_ids)] + [1] * 4
    assert talker[0]["tokens"] > 9 and [x["tokens"] for x in talker[1:]] == [1] * 5
    assert [x["tokens"] for x in code2wav] == [2, 2, 2]  # packets of 2, 2, then the last 2 of a 4
