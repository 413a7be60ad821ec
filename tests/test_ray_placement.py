"""`placement: ray` on a local Ray cluster (CPU): every stage replica in an actor gives what the local
placement gives; aborts free every actor's stage; a killed actor fails the engine as a dead stage thread does.

One Ray engine (6 actors: 2 thinkers, 2 talkers, 2 code2wavs) serves the whole file; the kill test is last."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from omnistage.config_loader import default_deploy_config, load_deploy_config
from omnistage.entrypoints.omni import ChatResult, Omni
from omnistage.models.qwen3_omni.make_tiny import tiny_checkpoint
from omnistage.models.qwen3_omni.model import load_config
from omnistage.pipeline.placement.local import Placement, replica_names
from omnistage.server.launch import LaunchError, deploy_config, deploy_overrides
from omnistage.server.serve_args import add_serve_args

from graph_helpers import settle
from placement_helpers import twins
from test_engine import conv, greedy

ray = pytest.importorskip("ray")
from omnistage.pipeline.placement.ray import actor_options, gpu_shares  # noqa: E402  (needs ray)

KV = 16 << 20  # small KV caches: quick to allocate in five processes
VOICES = ["Ethan", "Aiden", "Chelsie"]


def deploy(d):
    stages = {"thinker": {"replicas": 2, "kv_cache_memory": KV}, "talker": {"replicas": 2, "kv_cache_memory": KV},
              "code2wav": {"replicas": 2}}
    return load_deploy_config(default_deploy_config(d), platform="cpu", overrides={"stages": stages})


@pytest.fixture(scope="module")
def engines():
    ray.init(address="local", num_cpus=2, num_gpus=3, include_dashboard=False, object_store_memory=128 << 20,
             log_to_driver=False)
    d = tiny_checkpoint("tiny")
    try:
        with twins(d, deploy(d), "ray") as pair:
            yield pair
    finally:
        ray.shutdown()


def start(o: Omni, ids: list[str], tokens: int, frames: int) -> list[ChatResult]:
    """Greedy requests (every fourth one text only), added to the engine; their streams fill the results."""
    results = [ChatResult() for _ in ids]
    for i, (rid, r) in enumerate(zip(ids, results)):
        o.engine.add_request(o.engine.make_request(rid, conv(i), None, want_audio=i % 4 != 3,
                                                   voice=VOICES[i % 3], emit=r.add, **greedy(tokens, frames)))
    return results


def run(o: Omni, ids: list[str], tokens: int, frames: int) -> list[ChatResult]:
    """`start`, then until every stream finished (polled: a broken engine fails the test, never hangs it)."""
    results = start(o, ids, tokens, frames)
    settle(lambda: assert_all(r.finish_reason is not None for r in results), 60)
    return results


def test_same_tokens_codes_and_audio_as_the_local_placement(engines) -> None:
    remote, local = engines
    assert {"talker0", "talker1", "code2wav0", "code2wav1"} <= set(remote.engine.stats())
    before = remote.engine.stats()
    ids = [f"same{i}" for i in range(8)]
    a, b = run(remote, ids, 8, 15), run(local, ids, 8, 15)
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.token_ids == y.token_ids and len(x.token_ids) == 8 and x.text == y.text
        assert (x.finish_reason, x.usage) == (y.finish_reason, y.usage) == ("length", y.usage)
        assert x.usage.completion_tokens == 8 and x.usage.prompt_tokens > 0
        if i % 4 == 3:
            assert x.audio is None and x.usage.audio_frames == 0
            continue
        assert x.codes.shape == (16, 15) and np.array_equal(x.codes, y.codes) and x.usage.audio_frames == 15
        np.testing.assert_allclose(x.audio, y.audio, atol=1e-6)
    settle(lambda: check_rows(remote, before), 10)


def check_rows(o: Omni, before: dict) -> None:
    """Each talker and code2wav actor did part of the work (routing crossed actors)."""
    after = o.engine.stats()
    rows = {name: after[name]["step_rows"] - before[name]["step_rows"] for name in after}
    assert sum(rows[f"talker{i}"] for i in (0, 1)) == 6 * 15  # one row per frame of the 6 audio requests
    assert all(rows[name] > 0 for name in ("talker0", "talker1", "code2wav0", "code2wav1")), rows


def assert_all(flags) -> None:
    assert all(flags)


def held_by_every_stage(o: Omni, n: int) -> None:
    stats = o.engine.stats()
    for stage in ("talker", "code2wav"):
        assert sum(stats[f"{stage}{i}"]["active"] for i in (0, 1)) == n, stats


def all_free(o: Omni) -> None:
    stats = o.engine.stats()
    for name, s in stats.items():
        assert s["active"] == 0 and s["queue_depth"] == 0 and s.get("kv_blocks_used", 0) == 0, (name, s)
    assert o.engine.routing.talker.load == [0, 0] and o.engine.routing.code2wav.load == [0, 0]
    assert not o.engine.requests


def test_abort_mid_stream_frees_every_actor(engines) -> None:
    remote, local = engines
    frames = remote.engine.stages.talkers[0].kv_capacity // 2 - 64  # two fit a talker; never reached here
    before = remote.engine.stats()
    ids = [f"abort{i}" for i in range(3)]  # all with audio; talker0 gets two
    results = start(remote, ids, 30, frames)
    settle(lambda: assert_all(r.audio is not None for r in results), 30)
    settle(lambda: held_by_every_stage(remote, 3), 10)
    for rid in ids:
        assert remote.engine.abort(rid)
    settle(lambda: all_free(remote), 30)
    after = remote.engine.stats()
    talker_rows = sum(after[f"talker{i}"]["step_rows"] - before[f"talker{i}"]["step_rows"] for i in (0, 1))
    assert talker_rows < 3 * frames // 2  # the talkers stopped at the abort, not at max_frames
    assert all(r.finish_reason is None for r in results)  # an aborted stream gets no finish
    (again,), (alone,) = run(remote, ["again"], 6, 12), run(local, ["again"], 6, 12)
    assert again.token_ids == alone.token_ids and np.array_equal(again.codes, alone.codes)


def test_a_request_that_fails_in_an_actor_fails_alone(engines) -> None:
    remote, local = engines
    before = remote.engine.stats()
    bad = ChatResult()
    # NOTE: prompt ids with no assistant turn: the thinker runs it, the talker cannot build its prompt
    remote.engine.add_request(remote.engine.make_request(
        "bad", None, [1, 2, 3], want_audio=True, voice="Ethan", emit=bad.add, **greedy(4, 6)))
    good, alone = run(remote, ["good0", "good1"], 6, 10), run(local, ["good0", "good1"], 6, 10)
    settle(lambda: assert_all([bad.finish_reason == "error"]), 30)
    assert remote.engine.error is None
    for x, y in zip(good, alone):
        assert x.token_ids == y.token_ids and np.array_equal(x.codes, y.codes) and x.finish_reason == "length"
    settle(lambda: assert_all([failed(remote, before) in ({"talker0": 1}, {"talker1": 1})]), 10)
    settle(lambda: all_free(remote), 10)


def failed(o: Omni, before: dict) -> dict[str, int]:
    """Requests failed per stage since `before`, where any."""
    after = o.engine.stats()
    return {s: n for s in after if (n := after[s]["failed"] - before[s]["failed"])}


def test_placement_flag_and_deploy_key(tiny_dir) -> None:
    args = add_serve_args(argparse.ArgumentParser()).parse_args(["--placement", "ray"])
    assert deploy_config(tiny_dir, None, None, "cpu", deploy_overrides(args)).placement == "ray"
    args = add_serve_args(argparse.ArgumentParser()).parse_args(["--deploy-overrides", '{"placement":"ray"}'])
    assert deploy_config(tiny_dir, None, None, "cpu", deploy_overrides(args)).placement == "ray"
    assert deploy_config(tiny_dir, None, None, "cpu").placement == "local"
    with pytest.raises(LaunchError, match="placement: must be one of local, pipeline, process, ray"):
        deploy_config(tiny_dir, None, None, "cpu", {"placement": "mpi"})


def test_gpus_follow_the_deploy_devices(engines, tiny_dir) -> None:
    """One GPU bundle per deploy device index; the replicas on one index share its GPU evenly. (The test
    cluster declares GPUs it does not have: only the placement group is made, no actor.)"""
    stages = {"talker": {"replicas": 2, "devices": [0, 1]}, "code2wav": {"replicas": 3, "devices": [1, 2, 1]}}
    cfg = load_deploy_config(default_deploy_config(tiny_dir), platform="cuda", overrides={"stages": stages})
    p = Placement(load_config(tiny_dir), cfg, tiny_dir, device="cuda")
    replicas = replica_names(p)
    assert [(n, i) for n, i, _ in replicas] == [("thinker", 0), ("talker", 0), ("talker", 1),
                                                ("code2wav", 0), ("code2wav", 1), ("code2wav", 2)]
    # device 0: thinker, talker0 (1/2 each); device 1: talker1, code2wav0, code2wav2 (1/3 each); device 2
    assert gpu_shares(p, replicas) == [(0, 0.5), (0, 0.5), (1, 0.3333), (1, 0.3333), (2, 1.0), (1, 0.3333)]
    actor_p, options, free_gpus = actor_options(p, replicas)
    try:
        assert actor_p.device == "cuda:0" and p.device == "cuda"
        assert [o["num_gpus"] for o in options] == [s for _, s in gpu_shares(p, replicas)]
        strategies = [o["scheduling_strategy"] for o in options]
        assert [s.placement_group_bundle_index for s in strategies] == [0, 0, 1, 1, 2, 1]
        assert strategies[0].placement_group.bundle_specs == [{"GPU": 1}] * 3
    finally:
        free_gpus()
    assert actor_options(Placement(p.config, cfg, tiny_dir, device="cpu"), replicas)[1:] == (
        [{"num_cpus": 0}] * 6, None)


def test_a_killed_actor_fails_only_its_requests_and_is_made_again(engines) -> None:
    remote, local = engines
    engine = remote.engine
    ids = [f"kill{i}" for i in range(3)]
    results = start(remote, ids, 30, engine.stages.talkers[0].kv_capacity // 2 - 64)
    settle(lambda: assert_all(r.audio is not None for r in results), 30)
    on_talker0 = [r for rid, r in zip(ids, results) if engine.routing.talker._of[rid] == 0]
    assert len(on_talker0) == 2
    ray.kill(engine.stages.talkers[0].link.actor)
    settle(lambda: assert_all(r.finish_reason == "error" for r in on_talker0), 30)
    assert engine.error is None and [r.finish_reason for r in results if r not in on_talker0] == [None]
    for rid in ids:
        engine.abort(rid)
    settle(lambda: assert_all([engine.health()["status"] == "ok"]), 60)
    assert engine.stats()["talker0"]["restarts"] == 1
    for x, y in zip(run(remote, ["back0", "back1"], 6, 10), run(local, ["back0", "back1"], 6, 10)):
        assert x.token_ids == y.token_ids and np.array_equal(x.codes, y.codes) and x.finish_reason == "length"
    settle(lambda: all_free(remote), 30)
