"""Fault isolation and aborts in the engine (tiny checkpoint, in process): a fault in one request's work fails
that request only, a failed batched step fails that step's requests, a fatal error ends the engine loudly;
dropped streams are aborted in every stage within one step and give everything back."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from omnistage.config_loader import default_deploy_config, load_deploy_config
from omnistage.entrypoints.async_omni import AsyncOmni
from omnistage.entrypoints.omni import ChatResult, Omni
from omnistage.models.qwen3_omni.make_tiny import tiny_checkpoint
from omnistage.pipeline.faults import EngineDeadError
from omnistage.sampling_params import SamplingParams, TalkerSamplingParams

TOKENS, FRAMES = 6, 8
SAMPLING = dict(sampling={"temperature": 0, "max_tokens": TOKENS, "ignore_eos": True},
                talker_sampling={"max_frames": FRAMES, "ignore_eos": True})


def deploy():
    """The CPU deploy config with 16 MiB KV caches (thousands of tokens), so engines stay small."""
    small = {"stages": {"thinker": {"kv_cache_memory": 16 << 20}, "talker": {"kv_cache_memory": 16 << 20}}}
    return load_deploy_config(default_deploy_config(tiny_checkpoint("tiny")), platform="cpu", overrides=small)


def fresh() -> Omni:
    """An engine of its own (shut down by the test), for the faults that end it."""
    return Omni(tiny_checkpoint("tiny"), deploy=deploy(), device="cpu")


@pytest.fixture(scope="module")
def shared():
    o = fresh()
    yield o
    o.engine.shutdown()


def submit(o: Omni, ids: list[str]) -> dict[str, ChatResult]:
    results = {rid: ChatResult() for rid in ids}
    reqs = [o.engine.make_request(rid, [{"role": "user", "content": f"Say {rid}."}], None, want_audio=True,
                                  voice="Ethan", emit=results[rid].add, **SAMPLING) for rid in ids]
    for req in reqs:  # NOTE: added back to back, so the thinker admits them in one step
        o.engine.add_request(req)
    return results


def run(o: Omni, ids: list[str], timeout: float = 30) -> dict[str, ChatResult]:
    """The requests' results once each has finished (a test fails rather than hangs when one never does)."""
    results = submit(o, ids)
    deadline = time.monotonic() + timeout
    while any(r.finish_reason is None for r in results.values()) and time.monotonic() < deadline:
        time.sleep(0.005)
    assert all(r.finish_reason is not None for r in results.values()), "a request never finished"
    return results


def assert_complete(result: ChatResult) -> None:
    assert result.finish_reason == "length" and result.usage.completion_tokens == TOKENS
    assert result.usage.audio_frames == FRAMES and result.audio.size == FRAMES * 1920 - 555


def assert_all_free(o: Omni) -> None:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(s["active"] or s.get("kv_blocks_used")
                                              for s in o.engine.stats().values()):
        time.sleep(0.01)
    for name, s in o.engine.stats().items():
        assert s["active"] == 0 and s.get("kv_blocks_used", 0) == 0, (name, s)
    assert not o.engine.requests


def request_id(arg: object) -> str:
    for path in ("request_id", "req.request_id", "request.request_id"):
        obj = arg
        for name in path.split("."):
            obj = getattr(obj, name, None)
        if obj is not None:
            return obj
    raise AssertionError(arg)


# per-request host work in each stage: (stage, method); the first argument names the request
PER_REQUEST = [("thinker", "_admit"), ("thinker", "_append"), ("talker", "_admit"), ("talker", "_advance"),
               ("code2wav", "_emit")]


@pytest.mark.parametrize("stage_name, method", PER_REQUEST)
def test_a_fault_in_one_request_fails_only_that_request(shared, monkeypatch, stage_name, method):
    o = shared
    e = o.engine
    stage = {"thinker": e.thinker, "talker": e.talkers[0], "code2wav": e.code2wavs[0]}[stage_name]
    worker = next(w for w in o.engine.workers if w.stage is stage)
    failed_before, real = worker.failed_requests, getattr(stage, method)
    calls = {"bad": 0}

    def faulty(first, *args):
        if request_id(first) == "bad":
            calls["bad"] += 1
            raise RuntimeError("injected fault")
        return real(first, *args)

    monkeypatch.setattr(stage, method, faulty)
    results = run(o, ["ok0", "bad", "ok1", "ok2"])
    assert results["bad"].finish_reason == "error" and calls["bad"] == 1
    for rid in ("ok0", "ok1", "ok2"):
        assert_complete(results[rid])
    assert worker.failed_requests == failed_before + 1 and o.engine.error is None
    assert_all_free(o)
    monkeypatch.undo()
    assert_complete(run(o, ["after"])["after"])


def _raise_once(monkeypatch, obj: object, name: str, error: BaseException, stage: object = None) -> dict:
    """`obj.name` raises `error` on its next call; `stage`'s step requests at that moment are recorded."""
    real, state = getattr(obj, name), {"raised": 0}

    def once(*args, **kwargs):
        if not state["raised"]:
            state["raised"] += 1
            state["blamed"] = sorted(r.request_id for r in getattr(stage, "step_requests", []))
            raise error
        return real(*args, **kwargs)

    monkeypatch.setattr(obj, name, once)
    return state


@pytest.mark.parametrize("where", ["thinker", "talker", "code2wav"])
def test_a_failed_batched_step_fails_its_requests_and_the_engine_goes_on(shared, monkeypatch, where):
    o = shared
    e = o.engine
    stage = {"thinker": e.thinker, "talker": e.talkers[0], "code2wav": e.code2wavs[0]}[where]
    obj, name = {"thinker": lambda: (stage.thinker.model, "forward"),
                 "talker": lambda: (stage.talker, "forward"),
                 "code2wav": lambda: (stage.streamer, "step")}[where]()
    state = _raise_once(monkeypatch, obj, name, torch.OutOfMemoryError("injected"), stage)
    ids = ["b0", "b1", "b2"]
    results = run(o, ids)
    failed = sorted(rid for rid in ids if results[rid].finish_reason == "error")
    assert state["raised"] == 1 and failed and failed == state["blamed"] and o.engine.error is None
    for rid in set(ids) - set(failed):
        assert_complete(results[rid])
    assert_all_free(o)
    assert_complete(run(o, ["later"])["later"])


def test_a_fatal_device_error_fails_everything_and_refuses_new_requests(monkeypatch):
    o = fresh()
    _raise_once(monkeypatch, o.engine.talkers[0].talker, "forward", torch.AcceleratorError("device lost"))
    results = submit(o, ["x", "y"])
    wait_dead(o)
    assert [results[r].finish_reason for r in "xy"] == ["error", "error"]
    assert o.engine.error is not None and not o.engine.requests
    with pytest.raises(EngineDeadError):
        submit(o, ["z"])
    o.engine.shutdown()


def test_a_request_added_while_a_stage_dies_is_refused(monkeypatch):
    """The race: `add_request` checked `error` just before a stage died; it must not slip in unfailed."""
    o = fresh()
    o.engine._on_error(EngineDeadError("stage talker died"))  # what a dying worker does
    monkeypatch.setattr(type(o.engine), "error", property(lambda self: None))  # its check ran before that
    with pytest.raises(EngineDeadError):
        submit(o, ["late"])
    assert not o.engine.requests
    o.engine.shutdown()


def wait_dead(o: Omni) -> None:
    deadline = time.monotonic() + 10
    while o.engine.error is None and time.monotonic() < deadline:
        time.sleep(0.005)
    with pytest.raises(EngineDeadError):
        o.engine.wait(list(o.engine.requests))


def wait_for_text(result: ChatResult) -> None:
    deadline = time.monotonic() + 10
    while not result.text and time.monotonic() < deadline:
        time.sleep(0.005)
    assert result.text


def test_a_stage_that_keeps_failing_with_nothing_to_blame_is_dead(monkeypatch):
    o = fresh()
    results = submit(o, ["x"])
    wait_for_text(results["x"])
    calls = []

    def broken() -> None:
        calls.append(1)
        raise RuntimeError("scheduler bug")

    monkeypatch.setattr(o.engine.code2wavs[0], "_receive", broken)
    wait_dead(o)
    assert len(calls) == 3 and results["x"].finish_reason == "error"
    o.engine.shutdown()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_worker_thread_that_ended_makes_the_engine_unhealthy(monkeypatch):
    """The worker's own error handler fails too, so its thread ends without a word: the engine notices."""
    o = fresh()
    results = submit(o, ["x"])
    wait_for_text(results["x"])
    worker = next(w for w in o.engine.workers if w.name == "talker")

    def handler_breaks(*args) -> None:
        raise RuntimeError("the handler broke")

    monkeypatch.setattr(worker, "on_error", handler_breaks)
    _raise_once(monkeypatch, worker.stage.talker, "forward", torch.AcceleratorError("device lost"))
    deadline = time.monotonic() + 10
    while worker._thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert isinstance(o.engine.error, EngineDeadError) and "talker" in str(o.engine.error)
    assert results["x"].finish_reason == "error"
    with pytest.raises(EngineDeadError):
        submit(o, ["z"])
    o.engine.shutdown()


def test_dropped_streams_are_aborted_in_every_stage_within_a_step():
    """32 streams dropped after their first audio chunk: each stage lets go of each of them before its next
    step, none of them is in a later step, and every KV block and slot comes back."""
    engine = AsyncOmni(tiny_checkpoint("tiny"), deploy=deploy(), device="cpu")
    o = engine.engine
    steps = {w.name: 0 for w in o.workers}
    called_at: dict[str, dict[str, int]] = {}
    late, in_later_step, processed = [], [], {w.name: set() for w in o.workers}
    for w in o.workers:
        step, abort = w.stage.step, w.stage.abort

        def counted_step(w=w, step=step) -> bool:
            steps[w.name] += 1
            busy = step()
            in_later_step.extend(r.request_id for r in w.stage.step_requests
                                 if r.request_id in processed[w.name])
            return busy

        def recorded_abort(rid: str, w=w, abort=abort) -> None:
            if rid in called_at and rid not in processed[w.name]:
                late.append(steps[w.name] - called_at[rid][w.name])
                processed[w.name].add(rid)
            abort(rid)

        w.stage.step, w.stage.abort = counted_step, recorded_abort
    real_abort = o.abort

    def abort(rid: str) -> bool:
        called_at[rid] = dict(steps)
        return real_abort(rid)

    o.abort = abort

    async def drop_after_first_audio(i: int) -> None:
        stream = engine.generate(f"d{i}", [{"role": "user", "content": "Tell me a long story."}],
                                 SamplingParams(max_tokens=200, ignore_eos=True), TalkerSamplingParams(
                                     max_frames=400, ignore_eos=True), "Ethan")
        async for delta in stream:
            if delta.audio is not None:
                break
        await stream.aclose()

    async def main() -> None:
        await asyncio.gather(*(drop_after_first_audio(i) for i in range(32)))

    asyncio.run(main())
    assert len(called_at) == 32
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and sum(map(len, processed.values())) < 32 * len(o.workers):
        time.sleep(0.01)
    assert all(len(p) == 32 for p in processed.values()), {k: len(v) for k, v in processed.items()}
    assert len(late) == 32 * len(o.workers) and max(late) <= 1 and not in_later_step
    for name, s in o.stats().items():
        assert s["active"] == 0 and s.get("kv_blocks_used", 0) == 0, (name, s)
    assert not o.requests and engine.admission.requests == engine.admission.tokens == 0
    engine.shutdown()
