"""RemoteStage (the driver's handle of a replica in another process) over a fake link: adds and aborts reach
the replica in order, batched (one call per batch that queued while the previous call was made, not one per
payload); a growing prompt's features cross once; a replica that dies fails the requests it held, only them,
and is built again."""

from __future__ import annotations

import threading
import time

import torch

from omnistage.engine.request import Request
from omnistage.models.qwen3_omni.media_keys import MediaKeys
from omnistage.models.qwen3_omni.prompt import PromptInputs
from omnistage.pipeline.placement import remote, wire
from omnistage.pipeline.placement.remote import RemoteStage
from omnistage.pipeline.placement.replica_host import renew, request_copy
from omnistage.pipeline.thinker.growth import PromptPiece
from omnistage.sampling_params import SamplingParams, TalkerSamplingParams

from graph_helpers import settle


class SlowLink:
    """Each `send` takes 20 ms, as a busy replica's queue would; `drain` raises once `die` is set."""

    def __init__(self) -> None:
        self.batches: list[list[tuple]] = []
        self.die, self.killed, self.closed = threading.Event(), False, False

    def info(self) -> dict:
        return {"kv_capacity": None, "stats": {"active": 0}}

    def start(self) -> None:
        pass

    def send(self, ops: list[tuple]) -> None:
        time.sleep(0.02)
        self.batches.append(ops)

    def drain(self, timeout: float) -> tuple[list, dict]:
        if self.die.wait(timeout):
            raise EOFError("gone")
        return [], {"active": 0}

    def kill(self) -> None:
        self.killed = True

    def close(self) -> None:
        self.closed = True
        self.kill()


def request(i: int) -> Request:
    return Request(f"r{i}", PromptInputs([1, 2, 3]), SamplingParams(), TalkerSamplingParams(), i, lambda d: None)


def test_adds_and_aborts_arrive_in_order_batched() -> None:
    link = SlowLink()
    stage = RemoteStage(link, "talker", ("talker", 0), None, lambda *a: None, lambda rid: None)
    stage._sender.start()
    reqs, sent = [request(i) for i in range(10)], []
    for k in range(300):
        req = reqs[k % 10]
        if k % 37 == 36:
            stage.abort(req.request_id)
            sent.append(("abort", req.request_id))
        else:
            stage.add(req)
            sent.append(("add", req.request_id))
        time.sleep(0.0005)
    settle(lambda: check(sum(map(len, link.batches)) == len(sent)), 10)
    stage._stopping = True
    stage._sender.join(timeout=5)
    ops = [op for batch in link.batches for op in batch]
    assert [(op, rid) for op, rid, _, _ in ops] == sent  # every op, in the order made
    assert sum(spec is not None for _, _, spec, _ in ops) == 10  # a request's plain copy goes once
    assert len(link.batches) < len(sent) // 4  # batched: far fewer calls than payloads


def test_a_growing_prompt_crosses_whole_when_opened_or_restarted_only_keys_when_closed() -> None:
    link = SlowLink()
    stage = RemoteStage(link, "thinker", ("thinker", 0), None, lambda *a: None, lambda rid: None)
    stage._sender.start()
    keys = [MediaKeys((bytes([k]),) * (k + 1), (), (), ()) for k in range(3)]
    req = request(0)
    req.prompt, req.growing = PromptInputs([1, 2, 3], torch.randn(1, 128, 800), media_keys=keys[0]), True
    opened = req.prompt
    stage.add(req)
    req.prompt, req.growing = PromptInputs([1, 2, 3, 4], torch.randn(2, 128, 800), media_keys=keys[1]), False
    stage.add(PromptPiece(req, 3, [4], closed=True))  # the prepared close: one id
    req.prompt = PromptInputs([1, 2, 3, 5], torch.randn(2, 128, 800), media_keys=keys[2])
    stage.add(PromptPiece(req, 0, [], closed=True, restart=True))
    settle(lambda: check(sum(map(len, link.batches)) == 3), 10)
    stage._stopping = True
    (_, _, spec0, _), (_, _, close, _), (_, _, restart, _) = [op for batch in link.batches for op in batch]
    assert close == {"growing": False, "media_keys": keys[1]}
    assert len(wire.dumps(close)) < 200 < 409_600 < len(wire.dumps(restart))  # 800 frames x 128 mels x 4 B
    copy = request_copy(spec0, lambda d: None)
    renew(copy, close)  # what its thinker admitted (or will, before the pieces), with the whole prompt's keys
    assert (copy.prompt.input_ids, copy.prompt.media_keys, copy.growing) == ([1, 2, 3], keys[1], False)
    assert torch.equal(copy.prompt.input_features, opened.input_features)
    renew(copy, restart)
    assert copy.prompt.input_ids == [1, 2, 3, 5]
    assert torch.equal(copy.prompt.input_features, req.prompt.input_features)


def check(flag: bool) -> None:
    assert flag


def test_a_dead_replica_fails_what_it_held_and_is_built_again(monkeypatch) -> None:
    monkeypatch.setattr(remote, "DRAIN_WAIT_S", 0.01)
    first, second = SlowLink(), SlowLink()
    reqs = {r.request_id: r for r in (request(i) for i in range(3))}
    failed, states, built = [], [], threading.Event()

    def respawn() -> SlowLink:
        built.wait(5)
        return second

    def on_error(error, requests=None):
        failed.append(None if requests is None else sorted(r.request_id for r in requests))

    stage = RemoteStage(first, "talker1", ("talker", 1), None, on_error, reqs.get,
                        lambda *s: states.append(s), respawn)
    stage.start()
    stage.add(reqs["r0"])
    stage.add(reqs["r1"])
    del reqs["r1"]  # finished meanwhile: not failed again
    first.die.set()
    settle(lambda: check(stage.state == "restarting"), 5)
    assert failed == [["r0"]] and states == [("talker", 1, False)] and first.killed and stage.alive
    stage.add(reqs["r2"])  # routed here as it went down: it fails, it is not lost
    assert failed == [["r0"], ["r2"]]
    built.set()
    settle(lambda: check(stage.state == "up"), 5)
    assert states[-1] == ("talker", 1, True) and stage.stats()["restarts"] == 1
    stage.add(reqs["r2"])
    settle(lambda: check(sum(map(len, second.batches)) == 1), 5)
    assert second.batches[0][0][2] is not None  # the new process gets the request's plain copy
    stage._stopping = True


def test_past_its_restarts_a_replica_is_dead_and_the_engine_fails(monkeypatch) -> None:
    monkeypatch.setattr(remote, "DRAIN_WAIT_S", 0.01)
    monkeypatch.setattr(remote, "MAX_RESTARTS", 0)
    failed, link = [], SlowLink()
    stage = RemoteStage(link, "thinker", ("thinker", 0), None, lambda e, r=None: failed.append(r), {}.get,
                        None, lambda: SlowLink())
    stage.start()
    link.die.set()
    settle(lambda: check(stage.state == "dead"), 5)
    assert failed == [[], None] and not stage.alive  # nothing held; then the whole engine
