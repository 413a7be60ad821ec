"""`pipeline.routing.StageRouting` with stand-in stages: the talker gets a request's held text in order and at
once when `async_chunk` is off, every chunk of a request goes to one replica, the replicas on the producer's device
come first, and a released request leaves no load and no held text behind."""

from __future__ import annotations

from types import SimpleNamespace

from omnistage.config_loader import build_deploy_config
from omnistage.pipeline.routing import StageRouting


class Sink:
    def __init__(self) -> None:
        self.items: list = []

    def add(self, item) -> None:
        self.items.append(item)


def routing(data: dict) -> tuple[StageRouting, SimpleNamespace]:
    r = StageRouting(build_deploy_config(data, "cpu"))
    stages = SimpleNamespace(thinkers=[Sink(), Sink()], talkers=[Sink(), Sink()], code2wavs=[Sink(), Sink()])
    r.bind(stages)
    return r, stages


def request(rid: str) -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, aborted=False, session=None)


def chunks(req: SimpleNamespace, n: int) -> list[SimpleNamespace]:
    return [SimpleNamespace(request=req, finished=i == n - 1) for i in range(n)]


def test_text_held_until_done_then_to_one_talker_in_order() -> None:
    r, stages = routing({"async_chunk": False, "stages": {"talker": {"replicas": 2}}})
    a = chunks(request("a"), 3)
    for c in a[:2]:
        r.to_talker(c)
    assert [s.items for s in stages.talkers] == [[], []] and r.talker.load == [0, 0]
    r.to_talker(a[2])
    assert sorted([s.items for s in stages.talkers], key=len) == [[], a] and sorted(r.talker.load) == [0, 1]
    r.release("a")
    assert r.talker.load == [0, 0]


def test_streamed_chunks_stay_on_their_replica_and_go_near_the_producer() -> None:
    devices = {"devices": [0, 1], "replicas": 2}
    r, stages = routing({"stages": {"thinker": devices, "talker": devices, "code2wav": devices}})
    req = request("b")
    r.thinker.pick("b", prefer=[1])  # the request's thinker replica: the one on device 1
    for c in chunks(req, 3):
        r.to_talker(c)
    assert [len(s.items) for s in stages.talkers] == [0, 3]  # device 1's talker, though both are idle
    frame = SimpleNamespace(request=req, finished=False)
    r.to_code2wav(frame)
    assert stages.code2wavs[1].items == [frame]


def test_a_released_request_leaves_nothing_held_and_its_late_chunks_go_nowhere() -> None:
    r, stages = routing({"async_chunk": False})
    req = request("c")
    first, last = chunks(req, 2)
    r.to_talker(first)
    r.release("c")
    req.aborted = True  # NOTE: as `Orchestrator.abort` sets it before releasing
    r.to_talker(last)
    assert stages.talkers[0].items == [] and r._held == {} and r.talker.load == [0, 0]
