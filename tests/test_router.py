"""Sticky least-loaded routing over a stage's replicas (pipeline/placement/router.py), alone and in the engine."""

from __future__ import annotations

import threading
import time
from collections import Counter, defaultdict

import pytest

from omnistage.entrypoints.omni import ChatResult
from omnistage.pipeline.faults import NoReplicaError
from omnistage.pipeline.placement import router
from omnistage.pipeline.placement.router import Router

from graph_helpers import settle
from test_engine import conv, greedy, omni


def test_least_loaded_with_ties_to_the_lowest_index() -> None:
    r = Router(3)
    assert [r.pick(x) for x in "abcd"] == [0, 1, 2, 0]
    assert r.load == [2, 1, 1]
    r.release("a")
    r.release("c")
    assert r.load == [1, 1, 0]
    assert r.pick("e") == 2  # the only least-loaded replica
    assert r.pick("f") == 0  # three-way tie: the lowest index
    assert r.load == [2, 1, 1]


def test_a_request_sticks_to_its_replica() -> None:
    r = Router(2)
    assert (r.pick("a"), r.pick("b"), r.pick("c")) == (0, 1, 0)
    r.release("b")
    assert r.load == [2, 0]
    for _ in range(5):  # replica 1 is now idle, but every later payload of "a" and "c" stays on 0
        assert r.pick("a") == 0 and r.pick("c") == 0
    assert r.load == [2, 0]  # later payloads add no load


def test_release_frees_the_load_once() -> None:
    r = Router(2)
    r.pick("a")
    r.pick("b")
    r.release("a")
    r.release("a")  # a second release (finish after abort) and an unknown id change nothing
    r.release("never-routed")
    assert r.load == [0, 1]
    assert r.pick("a") == 0  # routed anew: a released request holds no place
    r.release("a")
    r.release("b")
    assert r.load == [0, 0]


class YieldingList(list):
    """A list whose reads let other threads run, as they may on a free-threaded build (CPython's GIL would
    otherwise run a whole `pick` without a thread switch, hiding a missing lock)."""

    def __getitem__(self, i):
        time.sleep(0)
        return super().__getitem__(i)


def test_concurrent_picks_and_releases_add_up() -> None:
    r, threads, per_thread = Router(3), 8, 200
    r.load = YieldingList(r.load)
    picked: list[dict[str, int]] = [{} for _ in range(threads)]
    start = threading.Barrier(threads)

    def work(t: int) -> None:
        start.wait()
        for k in range(per_thread):
            rid = f"{t}-{k}"
            picked[t][rid] = r.pick(rid)
            assert r.pick(rid) == picked[t][rid]

    run_all([lambda t=t: work(t) for t in range(threads)])
    counts = Counter(i for p in picked for i in p.values())
    assert r.load == [counts[i] for i in range(3)] and sum(r.load) == threads * per_thread
    assert max(r.load) - min(r.load) <= 1  # every pick took a least-loaded replica
    run_all([lambda p=p: [r.release(rid) for rid in p] for p in picked])
    assert r.load == [0, 0, 0]


def run_all(fns: list) -> None:
    pool = [threading.Thread(target=fn) for fn in fns]
    for th in pool:
        th.start()
    for th in pool:
        th.join()


def test_every_payload_of_a_request_reaches_one_replica_per_stage() -> None:
    o = omni(replicas=2)
    n, tokens, frames = 6, 5, 9
    seen: dict[str, list[Counter]] = {"talker": [Counter(), Counter()], "code2wav": [Counter(), Counter()]}
    stages = {"talker": o.engine.talkers, "code2wav": o.engine.code2wavs}
    for name, replicas in stages.items():
        for i, stage in enumerate(replicas):
            add = stage.add
            stage.add = lambda item, add=add, c=seen[name][i]: (
                c.update([item.request.request_id]), add(item))
    results = [ChatResult() for _ in range(n)]
    try:
        for i in range(n):
            o.engine.add_request(o.engine.make_request(
                f"sticky{i}", conv(i), None, want_audio=True, voice=["Ethan", "Aiden", "Chelsie"][i % 3],
                emit=results[i].add, **greedy(tokens, frames)))
        # NOTE: polled, not `wait`: a request whose payloads were split over replicas would never finish
        settle(lambda: assert_finished(results), 60)
    finally:
        for replicas in stages.values():
            for stage in replicas:
                del stage.add
    where: dict[str, dict[str, list[int]]] = defaultdict(dict)
    for name, counters in seen.items():
        ids = set().union(*counters)
        assert len(ids) == n
        for rid in ids:
            where[name][rid] = [i for i, c in enumerate(counters) if rid in c]
            assert len(where[name][rid]) == 1, f"{name}: {rid} reached replicas {where[name][rid]}"
        assert all(counters), f"{name}: a replica got no request"
    per_request = {name: {rid: sum(c[rid] for c in counters) for rid in where[name]}
                   for name, counters in seen.items()}
    # every text token (the first carries the prompt) and the end of the text; every frame and the end
    assert sorted(per_request["talker"].values()) == sorted(len(r.token_ids) + 1 for r in results)
    assert set(per_request["code2wav"].values()) == {frames + 1}
    assert all(r.finish_reason == "length" and r.codes.shape == (16, frames) for r in results)
    assert o.engine.routing.talker.load == [0, 0] and o.engine.routing.code2wav.load == [0, 0]


def assert_finished(results: list[ChatResult]) -> None:
    assert all(r.finish_reason is not None for r in results)


def test_a_session_follows_its_last_replica_while_it_is_up() -> None:
    r = Router(2)
    assert r.pick("a1", "alice") == 0 and r.pick("b1", "bob") == 1
    r.release("a1")
    r.release("b1")
    assert r.pick("x") == 0  # a request of no session: the least loaded
    assert r.pick("b2", "bob") == 1 and r.pick("b3", "bob") == 1  # bob's replica, though 0 is as loaded
    assert r.pick("a2", "alice") == 0
    r.set_up(0, False)
    assert r.pick("a3", "alice") == 1  # alice's replica is down: she moves, and stays moved
    r.set_up(0, True)
    assert r.pick("a4", "alice") == 1 and r.pick("y") == 0
    assert r.load == [3, 4]


def test_a_down_replica_takes_no_new_request_and_none_up_is_refused() -> None:
    r = Router(2)
    assert r.pick("a") == 0
    r.set_up(1, False)
    assert [r.pick(x) for x in "bcd"] == [0, 0, 0] and r.load == [4, 0]
    r.set_up(0, False)
    assert r.pick("a") == 0  # a request routed before keeps its replica (the stage fails it if it died)
    with pytest.raises(NoReplicaError):
        r.pick("e", "s")
    assert "e" not in r._of and r.load == [4, 0]
    r.set_up(1, True)
    assert r.pick("e", "s") == 1


def test_sessions_are_forgotten_oldest_first(monkeypatch) -> None:
    monkeypatch.setattr(router, "MAX_SESSIONS", 2)
    r = Router(2)
    r.pick("1", "s1"), r.pick("2", "s2"), r.pick("3", "s1"), r.pick("4", "s3")  # s2 least recently routed
    assert list(r._sessions) == ["s1", "s3"]
