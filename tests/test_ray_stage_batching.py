"""RayStage sends adds and aborts to its actor in order, batched: one Ray call per batch that queued
while the previous call was being made, not one per payload (a fake actor; no Ray cluster needed)."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("ray")

from omnistage.engine.request import Request  # noqa: E402
from omnistage.models.qwen3_omni.prompt import PromptInputs  # noqa: E402
from omnistage.pipeline.placement import ray as ray_placement  # noqa: E402
from omnistage.sampling_params import SamplingParams, TalkerSamplingParams  # noqa: E402


class Method:
    def __init__(self, fn) -> None:
        self.fn = fn

    def remote(self, *args):
        return self.fn(*args)


class SlowActor:
    """Each `handle` call takes 20 ms, as a busy actor's queue would."""

    def __init__(self) -> None:
        self.batches: list[list[tuple]] = []
        self.info = Method(lambda: {"kv_capacity": None, "stats": {"active": 0}})
        self.handle = Method(self._handle)

    def _handle(self, ops: list[tuple]) -> None:
        time.sleep(0.02)
        self.batches.append(ops)


def test_adds_and_aborts_arrive_in_order_batched(monkeypatch) -> None:
    monkeypatch.setattr(ray_placement.ray, "get", lambda ref, **kw: ref)
    actor = SlowActor()
    stage = ray_placement.RayStage(actor, "talker", None, lambda *a: None, lambda rid: None)
    stage._sender.start()
    reqs = [Request(f"r{i}", PromptInputs([1, 2, 3]), SamplingParams(), TalkerSamplingParams(), i,
                    lambda d: None) for i in range(10)]
    sent = []
    for k in range(300):
        req = reqs[k % 10]
        if k % 37 == 36:
            stage.abort(req.request_id)
            sent.append(("abort", req.request_id))
        else:
            stage.add(req)
            sent.append(("add", req.request_id))
        time.sleep(0.0005)
    deadline = time.monotonic() + 10
    while sum(map(len, actor.batches)) < len(sent) and time.monotonic() < deadline:
        time.sleep(0.01)
    stage._stopping = True
    stage._sender.join(timeout=5)
    ops = [op for batch in actor.batches for op in batch]
    assert [(op, rid) for op, rid, _, _ in ops] == sent  # every op, in the order made
    assert sum(spec is not None for _, _, spec, _ in ops) == 10  # a request's plain copy goes once
    assert len(actor.batches) < len(sent) // 4  # batched: far fewer calls than payloads
