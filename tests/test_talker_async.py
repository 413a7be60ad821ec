"""Asynchronous output (deploy `async_output`): the talker completes step N while step N+1 runs. Same
codes, audio, text and frame counts as completing each step at once, codec_eos stops included; aborts
free everything."""

from __future__ import annotations

import functools
import random
from dataclasses import replace

import numpy as np
import pytest
import torch

from omnistage.config import default_deploy_config, load_deploy_config
from omnistage.entrypoints.omni import Omni
from omnistage.models.qwen3_omni.make_tiny import tiny_checkpoint

from graph_helpers import add_and_abort, settle

PROMPTS = ["Say hello.", "Tell me about the sea and the sky.", "Why?", "One, two, three, four, five."]


@functools.cache
def omni(async_output: bool, graph: bool) -> Omni:
    d = tiny_checkpoint("tiny")
    small = {"kv_cache_memory": 1 << 25}  # 32 MiB: this module holds four engines
    cfg = load_deploy_config(default_deploy_config(d), platform="cpu", overrides={
        "async_output": async_output, "stages": {"thinker": small, "talker": small}})
    # NOTE: cuda_graph set past validation means "runner on, graphs captured only on CUDA" (as test_talker_graph)
    talker = replace(cfg.stages.talker, cuda_graph=graph, cuda_graph_batch_sizes=(1, 2, 4, 8))
    o = Omni(d, deploy=replace(cfg, stages=replace(cfg.stages, talker=talker)), device="cpu")
    assert o.engine.talkers[0].async_output is async_output and (o.engine.talkers[0].runner is not None) is graph
    return o


def run(o: Omni, frames: list[int], ignore_eos: bool = True, seed: int | None = None) -> list:
    """Greedy, or (`seed`) sampled talkers with per-request seeds (the request's seed drives every stage)."""
    talker = [{"temperature": 0 if seed is None else 0.9, "max_frames": f, "ignore_eos": ignore_eos}
              for f in frames]
    sampling = [{"temperature": 0, "max_tokens": 6, **({} if seed is None else {"seed": seed + i})}
                for i in range(len(frames))]
    return o.chat([[{"role": "user", "content": PROMPTS[i % 4]}] for i in range(len(frames))],
                  voice=["Ethan", "Aiden", "Chelsie"][:1] * len(frames), sampling=sampling, talker_sampling=talker)


def same(a: list, b: list) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids and x.codes.shape == y.codes.shape and np.array_equal(x.codes, y.codes)
        np.testing.assert_allclose(x.audio, y.audio, rtol=0, atol=1e-6)


@pytest.mark.parametrize("graph", [False, True])
def test_async_output_equals_completing_each_step(graph: bool) -> None:
    frames = [5, 13, 1, 21, 8]
    same(run(omni(True, graph), frames), run(omni(False, graph), frames))
    same(run(omni(True, graph), frames, seed=7), run(omni(False, graph), frames, seed=7))


def test_async_output_stops_at_codec_eos_as_sync() -> None:
    free = run(omni(False, False), [24])[0].codes
    k = next(t for t in range(8, 24) if free[0, t] not in free[0, :t])  # the first new code at frame >= 8
    saved = []
    for o in (omni(True, False), omni(False, False)):
        head, eos = o.engine.talkers[0].talker.codec_head.weight, o.engine.talkers[0].talker.codec_eos
        saved.append((head, eos, head[eos].clone()))
        with torch.no_grad():
            head[eos] = head[int(free[0, k])] * 1.05  # codec_eos now wins where that code would (or earlier)
    try:
        a, b = run(omni(True, False), [24, 24], False), run(omni(False, False), [24, 24], False)
    finally:
        with torch.no_grad():
            for head, eos, row in saved:
                head[eos] = row
    same(a, b)
    assert 0 < a[0].codes.shape[1] <= k  # stopped by codec_eos, not max_frames
    assert [r.usage.audio_frames for r in a] == [r.codes.shape[1] for r in a]
    settle(lambda: clean(omni(True, False)), 30)  # the frame computed past codec_eos went nowhere


def clean(o: Omni) -> None:
    t, c = o.engine.talkers[0], o.engine.code2wavs[0]
    assert not o.engine.requests and not t.seqs and t.pending is None and t.blocks.num_used == 0 and not c.seqs


def test_async_output_aborts_free_everything() -> None:
    o = omni(True, True)
    rng = random.Random(1)
    add_and_abort(o.engine, 40, lambda i: o.engine.make_request(
        f"x{i}", [{"role": "user", "content": PROMPTS[i % 4]}], None, want_audio=True, voice="Ethan",
        emit=lambda d: None, sampling={"temperature": 0, "max_tokens": rng.randint(1, 6)},
        talker_sampling={"temperature": 0, "max_frames": rng.randint(1, 20), "ignore_eos": True}), rng, 0.3)

    settle(lambda: clean(o), 60)
