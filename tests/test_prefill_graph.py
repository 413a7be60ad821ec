"""Prefill graphs (`pipeline.prefill_graph`: fresh text prompts padded to a token bucket) against eager
prefills, on the CPU through the same static buffers (emulated capture): same tokens, codes and audio;
the prefill writes KV only to its prompts' slots and the scratch block."""

from __future__ import annotations

import functools
from dataclasses import replace

import numpy as np
import pytest
import torch

from omnistage.config_loader import default_deploy_config, load_deploy_config
from omnistage.entrypoints.omni import Omni
from omnistage.layers.context import build_context, forward_context
from omnistage.models.qwen3_omni.make_tiny import tiny_checkpoint
from graph_helpers import EmulatedGraphs, kv
from mm_samples import TINY, image, tone, video

PROMPTS = ["Say hello.", "Tell me about the sea and the sky, then about the mountains and the rivers.", "Why?",
           "One, two, three, four, five."]
BLOCK = 4
BUCKETS = (16, 32, 64, 128, 256)


@functools.cache
def omni(prefill: bool, budget: int = 8192) -> Omni:
    """`budget`: the thinker's token budget per step."""
    d = tiny_checkpoint("tiny")
    small = {"stages": {"thinker": {"block_size": BLOCK, "max_batch_size": 4, "max_num_batched_tokens": budget},
                        "talker": {"block_size": BLOCK}}}
    cfg = load_deploy_config(default_deploy_config(d), platform="cpu", overrides=small)
    # NOTE: cuda_graph set past validation (the cpu platform refuses it): the runners run eagerly here.
    stages = {name: replace(getattr(cfg.stages, name), cuda_graph=True, cuda_graph_batch_sizes=(1, 2, 4),
                            cuda_graph_prefill_tokens=BUCKETS if prefill else ())
              for name in ("thinker", "talker")}
    return Omni(d, deploy=replace(cfg, stages=replace(cfg.stages, **stages)), device="cpu")


def chat(o: Omni, n: int, audio: bool = True):
    sampling = [{"temperature": 0, "max_tokens": m, "ignore_eos": True} for m in (5, 9, 3, 7)[:n]]
    return o.chat([[{"role": "user", "content": PROMPTS[i]}] for i in range(n)],
                  modalities=("text", "audio") if audio else ("text",), sampling=sampling,
                  talker_sampling={"temperature": 0, "max_frames": 10, "ignore_eos": True})


def counting(runner, captures: list | None = None, cached: list | None = None) -> list[int]:
    """Records the rows of every `runner.run` (and into `captures` whether it asked for the capture layer,
    into `cached` the rows its prompts had in the cache)."""
    calls, run = [], runner.run

    def spy(embeds, positions, lens, tables, capture=False, deepstack=None, computed=()):
        calls.append(sum(lens))
        if captures is not None:
            captures.append((capture, deepstack is not None))
        if cached is not None:
            cached.append(sum(computed))
        return run(embeds, positions, lens, tables, capture, deepstack, computed)

    runner.run = spy
    return calls


def test_tokens_codes_and_audio_equal_eager_prefills() -> None:
    eager = chat(omni(False), 4)
    stages = [omni(True).engine.thinker, omni(True).engine.talkers[0]]
    assert all(s.prefill is not None for s in stages) and omni(False).engine.thinker.prefill is None
    for s in stages:
        s.prefill.graphs = EmulatedGraphs()  # what the buffers hold at capture (padding only) and replay
    calls = [counting(s.prefill) for s in stages]
    try:
        ran = chat(omni(True), 4)
    finally:
        for s in stages:
            s.prefill.graphs = None
            del s.prefill.run
    assert all(calls) and all(0 < rows <= BUCKETS[-1] for c in calls for rows in c)
    assert sum(calls[0]) == sum(r.usage.prompt_tokens for r in eager)  # every thinker prompt row, once
    for a, b in zip(ran, eager):
        assert a.token_ids == b.token_ids and np.array_equal(a.codes, b.codes)
        np.testing.assert_allclose(a.audio, b.audio, rtol=0, atol=1e-5)


MEDIA = {"audio": {"type": "audio", "audio": tone(1.1)}, "image": {"type": "image", "image": image(3, 30, 44)},
         "video": {"type": "video", "video": video(4, 4, 1.0), **TINY}}


@pytest.mark.parametrize("kind", list(MEDIA))
def test_media_prompts_take_the_prefill_graphs_with_the_accept_layer(kind: str) -> None:
    """A prompt with audio, an image or a video runs in the capture-layer graphs (DeepStack rows in their
    buffers); the talker's prompt reads their accept-layer rows: the same tokens, codes and audio as eager
    prefills. Asked again, its rows past the cached prefix (whole blocks, one row at least left) run in the
    graphs past cached rows, the prefix's accept-layer rows from the cache (thinker/prefix.py)."""
    conv = [{"role": "system", "content": f"{kind.title()}: look."},  # its own first block: nothing cached yet
            {"role": "user", "content": [MEDIA[kind], "What is this?"]}]
    kw = dict(sampling={"temperature": 0, "max_tokens": 5, "ignore_eos": True},
              talker_sampling={"temperature": 0, "max_frames": 8, "ignore_eos": True})
    eager = omni(False).chat(conv, **kw)
    runner, captures, cached = omni(True).engine.thinker.prefill, [], []
    runner.graphs = graphs = EmulatedGraphs()
    calls = counting(runner, captures, cached)
    try:
        ran, again = omni(True).chat(conv, **kw), omni(True).chat(conv, **kw)
    finally:
        runner.graphs = None
        del runner.run
    assert {k[3] for k in graphs.fns} == {False, True}  # fresh, then past the cached rows
    prompt = eager.usage.prompt_tokens
    hit = (prompt - 1) // BLOCK * BLOCK
    assert calls == [prompt, prompt - hit] and cached == [0, hit]
    assert captures == [(True, kind != "audio"), (True, False)]  # the new rows: text, no DeepStack rows
    for got in (ran, again):
        assert got.token_ids == eager.token_ids and np.array_equal(got.codes, eager.codes)
        np.testing.assert_allclose(got.audio, eager.audio, rtol=0, atol=1e-5)


@pytest.mark.parametrize("budget, steps", [(40, [[11, 25], [10, 18]]), (20, [[11], [19], [6, 10], [17], [1]])])
def test_a_prompt_is_split_only_when_it_prefills_alone(budget: int, steps: list[list[int]]) -> None:
    """Whole prompts fill a step while they fit its budget (prompts of 11, 25, 10 and 18 tokens): a split
    prompt's later chunks miss the prefill graphs. One longer than what is left is split only when no other
    prompt prefills in the step (at budget 20: 25 tokens as 19 beside a decode row, then 6; 18 as 17 beside
    three decode rows, then 1)."""
    o = omni(True, budget)
    stage, chunks = o.engine.thinker, []
    eager = stage.eager

    def spy(batch):
        chunks.append([n for s, n in batch if s.in_prefill])
        return eager(batch)

    stage.eager = spy
    try:
        ran = chat(o, 4, audio=False)
    finally:
        stage.eager = eager
    assert [c for c in chunks if c] == steps
    assert [r.usage.prompt_tokens for r in ran] == [11, 25, 10, 18]
    assert [r.token_ids for r in ran] == [r.token_ids for r in chat(omni(True), 4, audio=False)]


def test_run_matches_the_eager_forward_and_writes_only_live_slots() -> None:
    stage = omni(True).engine.thinker
    runner, model = stage.prefill, stage.thinker.model
    lens = [5, 11, 3]  # 19 rows -> bucket 32: a padding sequence of 13 rows, then empty sequences
    tables = [[10, 11], [12, 13, 14], [15]]
    embeds = torch.randn(sum(lens), runner.embeds.shape[1])
    positions = torch.cat([torch.arange(n) for n in lens])
    for layer in model.layers:  # an earlier test's padding K/V may sit in the scratch block already
        for cache in (layer.self_attn.attn.k_cache, layer.self_attn.attn.v_cache):
            cache[runner.scratch].normal_()
    before = kv(model).clone()
    hidden = runner.run(embeds, positions, lens, tables)[0].clone()
    after = kv(model).clone()
    with forward_context(build_context([0] * 3, lens, tables, BLOCK)):
        ref = model(embeds, positions)[0]
    torch.testing.assert_close(hidden, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(after, kv(model), rtol=1e-5, atol=1e-5)  # the eager forward rewrote the same
    slots = (after != before).flatten(4).any(-1).flatten(0, 1).any(0).flatten()
    live = {t[p // BLOCK] * BLOCK + p % BLOCK for n, t in zip(lens, tables) for p in range(n)}
    scratch = set(range(runner.scratch * BLOCK, (runner.scratch + 1) * BLOCK))
    changed = set(slots.nonzero()[:, 0].tolist())
    assert live <= changed <= live | scratch and changed & scratch


@pytest.mark.parametrize("lens", [[16], [1], [40, 60, 28]])
def test_bucket_edges(lens: list[int]) -> None:
    # a prompt filling its bucket exactly (no padding rows), one row, and three prompts over one bucket
    runner, model = omni(True).engine.thinker.prefill, omni(True).engine.thinker.thinker.model
    width = [-(-n // BLOCK) for n in lens]
    tables = [list(range(1 + sum(width[:i]), 1 + sum(width[:i + 1]))) for i in range(len(lens))]
    embeds = torch.randn(sum(lens), runner.embeds.shape[1])
    positions = torch.cat([torch.arange(n) for n in lens])
    hidden = runner.run(embeds, positions, lens, tables)[0].clone()
    with forward_context(build_context([0] * len(lens), lens, tables, BLOCK)):
        torch.testing.assert_close(hidden, model(embeds, positions)[0], rtol=1e-5, atol=1e-5)
    assert runner.fits(lens) and not runner.fits([BUCKETS[-1] + 1]) and not runner.fits([1] * 65)


@functools.cache
def omni_cuda(early_talker_prompt: bool = False) -> Omni:
    d = tiny_checkpoint("tiny")
    cfg = load_deploy_config(default_deploy_config(d), platform="cuda", stage_overrides={
        name: {"block_size": BLOCK, "kv_cache_memory": 2**26, "cuda_graph_batch_sizes": [1, 2, 4],
               "cuda_graph_capture_widths": [], "cuda_graph_prefill_tokens": list(BUCKETS)}
        for name in ("thinker", "talker", "code2wav")},
        overrides={"placement": "local",  # the tests read its stages in this process
                   "connector": {"talker_prompt_at_admission": early_talker_prompt}})
    return Omni(d, deploy=cfg, device="cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and flash attention need a GPU")
@pytest.mark.parametrize("lens", [[5, 11, 3], [16], [1], [40, 60, 28, 100]])
def test_captured_graph_matches_the_eager_forward_on_cuda(lens: list[int]) -> None:
    stage = omni_cuda().engine.thinker
    runner, model = stage.prefill, stage.thinker.model
    assert runner.graphs is not None and set(runner.graphs.graphs) == {  # captured at start
        (t, c, d, p) for t in BUCKETS for c, d in ((False, False), (True, False), (True, True)) for p in (False, True)}
    width = [-(-n // BLOCK) for n in lens]
    tables = [list(range(1 + sum(width[:i]), 1 + sum(width[:i + 1]))) for i in range(len(lens))]
    g = torch.Generator("cuda").manual_seed(sum(lens))
    embeds = torch.randn(sum(lens), runner.embeds.shape[1], device="cuda", generator=g).to(runner.embeds.dtype)
    positions = torch.cat([torch.arange(n) for n in lens]).cuda()
    hidden = runner.run(embeds, positions, lens, tables)[0].clone()
    with forward_context(build_context([0] * len(lens), lens, tables, BLOCK, "cuda")):
        ref = model(embeds, positions)[0]
    assert torch.isfinite(hidden).all()
    torch.testing.assert_close(hidden.float(), ref.float(), rtol=3e-2, atol=3e-2)


def test_groups_and_last_rows_over_several_runs() -> None:
    stage = omni(True).engine.talkers[0]
    runner, model = stage.prefill, stage.talker.model
    assert runner.groups([200, 100, 150, 256, 1]) == [(0, 1), (1, 3), (3, 4), (4, 5)]
    assert runner.groups([1] * 70) == [(0, 64), (64, 70)] and runner.groups([10, 257]) is None
    lens = [200, 100, 150, 256, 1]  # four runs, the fourth filling its bucket
    width = [-(-n // BLOCK) for n in lens]
    tables = [list(range(1 + sum(width[:i]), 1 + sum(width[:i + 1]))) for i in range(len(lens))]
    embeds = torch.randn(sum(lens), runner.embeds.shape[1])
    positions = torch.cat([torch.arange(n) for n in lens])
    last = runner.run_last(embeds, positions, lens, tables)
    with forward_context(build_context([0] * len(lens), lens, tables, BLOCK)):
        ref = model(embeds, positions)[0][torch.tensor(lens).cumsum(0) - 1]
    torch.testing.assert_close(last, ref, rtol=1e-5, atol=1e-5)
