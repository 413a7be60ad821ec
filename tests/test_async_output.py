"""Asynchronous output (deploy `async_output`): the thinker, the talker and code2wav complete step N while
step N+1 runs. Same tokens, text, codes, audio and frame counts as completing each step at once (penalties,
stop strings and codec_eos stops included); aborts free everything (KV blocks, penalty rows, stream slots)."""

from __future__ import annotations

import functools
import random
from dataclasses import replace

import numpy as np
import pytest
import torch

from omnistage.config_loader import default_deploy_config, load_deploy_config
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
    thinker = replace(cfg.stages.thinker, cuda_graph=graph, cuda_graph_batch_sizes=(1, 2, 4, 8),
                      cuda_graph_capture_widths=(1,))
    o = Omni(d, deploy=replace(cfg, stages=replace(cfg.stages, talker=talker, thinker=thinker)), device="cpu")
    for stage in (o.engine.talkers[0], o.engine.thinker):
        assert stage.async_output is async_output and (stage.runner is not None) is graph
    assert o.engine.code2wavs[0].async_output is async_output
    return o


def run(o: Omni, frames: list[int], ignore_eos: bool = True, seed: int | None = None, **thinker) -> list:
    """Greedy, or (`seed`) sampled talkers with per-request seeds (the request's seed drives every stage);
    `thinker`: more thinker sampling parameters."""
    talker = [{"temperature": 0 if seed is None else 0.9, "max_frames": f, "ignore_eos": ignore_eos}
              for f in frames]
    sampling = [{"temperature": 0, "max_tokens": 6, **({} if seed is None else {"seed": seed + i}), **thinker}
                for i in range(len(frames))]
    return o.chat([[{"role": "user", "content": PROMPTS[i % 4]}] for i in range(len(frames))],
                  voice=["Ethan", "Aiden", "Chelsie"][:1] * len(frames), sampling=sampling, talker_sampling=talker)


def same(a: list, b: list) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids and x.text == y.text and x.finish_reason == y.finish_reason
        assert x.codes.shape == y.codes.shape and np.array_equal(x.codes, y.codes)
        np.testing.assert_allclose(x.audio, y.audio, rtol=0, atol=1e-6)


@pytest.mark.parametrize("graph", [False, True])
def test_async_output_equals_completing_each_step(graph: bool) -> None:
    frames = [5, 13, 1, 21, 8]
    same(run(omni(True, graph), frames), run(omni(False, graph), frames))
    same(run(omni(True, graph), frames, seed=7), run(omni(False, graph), frames, seed=7))
    # penalties read the tokens of the step in flight (recorded on the device, not by the host)
    pen = dict(temperature=1.5, repetition_penalty=0.05, presence_penalty=-4.0, frequency_penalty=-2.0, max_tokens=12)
    a, b = run(omni(True, graph), frames, seed=3, **pen), run(omni(False, graph), frames, seed=3, **pen)
    same(a, b)
    assert any(len(set(r.token_ids)) < len(r.token_ids) for r in a)  # the penalties made it repeat tokens


def test_async_output_stops_on_a_stop_string_as_sync() -> None:
    free = run(omni(False, True), [3] * 4)
    stops = [r.text[len(r.text) // 2:][:2] or "x" for r in free]  # a piece from the middle of each text
    a = [run(omni(True, True), [3], stop=[s]) for s in stops]
    b = [run(omni(False, True), [3], stop=[s]) for s in stops]
    for x, y in zip(a, b):
        same(x, y)
    assert sum(r[0].finish_reason == "stop" and len(r[0].token_ids) < 6 for r in a) >= 2


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
    t, c, th = o.engine.talkers[0], o.engine.code2wavs[0], o.engine.thinker
    assert not o.engine.requests and not t.seqs and t.pending is None and t.blocks.num_used == 0
    assert not c.seqs and c.pending is None and len(c.streamer.cache.free_slots) == c.max_batch_size
    assert th.pending is None and th.blocks.num_used == 0 and th.penalties.num_free == th.scheduler.max_batch_size
    assert t.penalties.num_free == t.penalties.scratch  # every talker row back


def test_async_output_aborts_free_everything() -> None:
    o = omni(True, True)
    rng = random.Random(1)
    add_and_abort(o.engine, 40, lambda i: o.engine.make_request(
        f"x{i}", [{"role": "user", "content": PROMPTS[i % 4]}], None, want_audio=True, voice="Ethan",
        emit=lambda d: None, sampling={"temperature": 0, "max_tokens": rng.randint(1, 6)},
        talker_sampling={"temperature": 0, "max_frames": rng.randint(1, 20), "ignore_eos": True}), rng, 0.3)

    settle(lambda: clean(o), 60)
