"""`placement: pipeline` (each data-parallel pipeline in a worker process of its own, the local placement inside),
on the CPU: two pipelines give the same tokens, codes and audio as one local engine; a session stays on one
pipeline; aborts free both; a killed pipeline process fails only its requests, is started again, and serves."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omnistage.config_loader import default_deploy_config, load_deploy_config
from omnistage.entrypoints.omni import Omni
from omnistage.models.qwen3_omni.make_tiny import tiny_checkpoint

from graph_helpers import settle
from placement_helpers import check, gpu_twins, run, start, streamed_turn, twins

KV = 16 << 20
PIPELINES = ("pipeline0", "pipeline1")


def deploy(d, n: int):
    stages = {"thinker": {"kv_cache_memory": KV}, "talker": {"kv_cache_memory": KV}}
    return load_deploy_config(default_deploy_config(d), platform="cpu",
                              overrides={"data_parallel_size": n, "stages": stages})


@pytest.fixture(scope="module")
def engines():
    d = tiny_checkpoint("tiny")
    with twins(d, deploy(d, 2), "pipeline", local_deploy=deploy(d, 1)) as pair:
        yield pair


def rows(o: Omni, before: dict) -> dict[str, int]:
    after = o.engine.stats()
    return {p: after[f"{p}.thinker"]["step_rows"] - before[f"{p}.thinker"]["step_rows"] for p in PIPELINES}


def test_same_tokens_codes_and_audio_as_one_local_engine(engines) -> None:
    remote, local = engines
    assert {f"{p}.{s}" for p in PIPELINES for s in ("thinker", "talker", "code2wav")} == set(remote.engine.stats())
    before = remote.engine.stats()
    ids = [f"same{i}" for i in range(8)]
    for x, y in zip(run(remote, ids, 8, 15), run(local, ids, 8, 15)):
        assert x.token_ids == y.token_ids and len(x.token_ids) == 8 and x.finish_reason == y.finish_reason
        assert x.usage == y.usage
        if y.codes is not None:
            assert np.array_equal(x.codes, y.codes) and x.codes.shape == (16, 15)
            np.testing.assert_allclose(x.audio, y.audio, atol=1e-6)
    settle(lambda: check(all(rows(remote, before).values())), 10)  # both pipelines did part of the work


def test_a_session_stays_on_one_pipeline(engines) -> None:
    remote, local = engines
    for turn in range(3):
        before = remote.engine.stats()
        (x,), (y,) = run(remote, [f"s{turn}"], 4, 3, session="bob"), run(local, [f"s{turn}"], 4, 3)
        assert x.token_ids == y.token_ids and np.array_equal(x.codes, y.codes)
        on = remote.engine.routing.thinker._sessions["bob"]
        settle(lambda: check(rows(remote, before)[PIPELINES[on]] > 0), 10)
        assert rows(remote, before)[PIPELINES[1 - on]] == 0


def all_free(o: Omni) -> None:
    for name, s in o.engine.stats().items():
        assert s["active"] == 0 and s["queue_depth"] == 0 and s.get("kv_blocks_used", 0) == 0, (name, s)
    assert o.engine.routing.thinker.load == [0, 0] and not o.engine.requests


def test_abort_mid_stream_frees_both_pipelines(engines) -> None:
    remote, _ = engines
    results = start(remote, [f"abort{i}" for i in range(3)], 30, 2000)
    settle(lambda: check(all(r.audio is not None for r in results)), 30)
    for i in range(3):
        assert remote.engine.abort(f"abort{i}")
    settle(lambda: all_free(remote), 30)
    assert all(r.finish_reason is None for r in results)


def test_a_spoken_turn_streams_into_its_pipeline_exactly(engines) -> None:
    streamed_turn(*engines, [f"{p}.thinker" for p in PIPELINES])
    settle(lambda: all_free(engines[0]), 30)


def test_a_killed_pipeline_fails_only_its_requests_and_comes_back(engines) -> None:
    remote, local = engines
    engine = remote.engine
    long = start(remote, ["k0", "k1"], 30, 2000)  # one per pipeline (least loaded)
    settle(lambda: check(all(r.audio is not None for r in long)), 30)
    victim = engine.routing.thinker._of["k0"]
    assert engine.routing.thinker._of["k1"] == 1 - victim
    engine.stages.thinkers[victim].link.process.kill()
    settle(lambda: check(long[0].finish_reason == "error"), 20)
    assert long[1].finish_reason is None and engine.error is None
    assert engine.health() == {"status": "degraded", "replicas": {f"pipeline{victim}": "restarting"}}
    (x,), (y,) = run(remote, ["during"], 5, 6), run(local, ["during"], 5, 6)
    assert x.token_ids == y.token_ids and np.array_equal(x.codes, y.codes)
    assert engine.abort("k1")
    settle(lambda: check(engine.health()["status"] == "ok"), 60)
    assert engine.stats()[f"pipeline{victim}.talker"]["restarts"] == 1
    again = run(remote, ["a0", "a1"], 6, 10)
    for x, y in zip(again, run(local, ["a0", "a1"], 6, 10)):
        assert x.token_ids == y.token_ids and np.array_equal(x.codes, y.codes)
    settle(lambda: all_free(remote), 30)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_the_gpu_the_same_as_the_local_placement() -> None:
    """One pipeline in its process on the GPU against the local placement: the same tokens and codes."""
    with gpu_twins("pipeline") as (remote, local):
        ids = [f"gpu{i}" for i in range(4)]
        for x, y in zip(run(remote, ids, 8, 12), run(local, ids, 8, 12)):
            assert x.token_ids == y.token_ids and x.usage == y.usage
            if y.codes is not None:
                assert np.array_equal(x.codes, y.codes)  # NOTE: audio may differ by code2wav's batch shapes
