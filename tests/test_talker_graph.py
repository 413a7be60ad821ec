"""The talker's decode-step runner (static buffers, padded batch / KV-width buckets; CUDA graphs on CUDA)
against the eager engine, on the CPU: same codes and audio, padding rows confined to the scratch block."""

from __future__ import annotations

import functools
import random
from dataclasses import replace

import numpy as np
import pytest
import torch

from omnistage.config_loader import default_deploy_config, load_deploy_config
from omnistage.engine.cuda_graph import StaticDecodeContext, batch_bucket, width_bucket
from omnistage.entrypoints.omni import Omni
from omnistage.layers.attention import paged_decode_attention
from omnistage.layers.context import build_context
from omnistage.models.qwen3_omni.make_tiny import tiny_checkpoint

import graph_helpers
from graph_helpers import EmulatedGraphs, add_and_abort, settle

PROMPTS = ["Say hello.", "Tell me about the sea and the sky, then about the mountains.", "Why?",
           "One, two, three, four, five.", "Name a colour.", "What is the capital of France?"]
VOICES = ["Ethan", "Chelsie", "Aiden"]
SIZES = (1, 2, 4, 8)
BLOCK = 4  # small blocks: KV widths cross several buckets within a few dozen frames


@functools.cache
def omni(graph: bool) -> Omni:
    d = tiny_checkpoint("tiny")
    small = {"stages": {"talker": {"block_size": BLOCK, "kv_cache_memory": 1 << 18}}}  # 128 blocks
    cfg = load_deploy_config(default_deploy_config(d), platform="cpu", overrides=small)
    # NOTE: the deploy config refuses cuda_graph on the cpu platform; set past validation, it means
    # "runner on, graphs captured only on CUDA": the static-buffer path runs eagerly here.
    talker = replace(cfg.stages.talker, cuda_graph=graph, cuda_graph_batch_sizes=SIZES,
                       cuda_graph_capture_widths=(1,),  # every width bucket reachable
                       cuda_graph_prefill_tokens=())  # decode runner alone (tests/test_prefill_graph.py)
    # NOTE: no prefix cache: each request writes (and the tests read) all of its own KV rows
    return Omni(d, deploy=replace(cfg, stages=replace(cfg.stages, talker=talker), enable_prefix_caching=False),
                device="cpu")


def spy(o: Omni):
    runner = o.engine.talkers[0].runner
    return graph_helpers.spy(runner, o.engine.talkers[0].talker.model, BLOCK, lambda batch: {
        t[c // BLOCK] * BLOCK + c % BLOCK for t, c in zip(batch.tables, batch.num_computed)})


def kv(o: Omni) -> torch.Tensor:
    return graph_helpers.kv(o.engine.talkers[0].talker.model)


def chat(o: Omni, n: int, talker_sampling: list[dict], seeds: list[int] | None = None):
    sampling = [{"temperature": 0, "max_tokens": 3 + i % 5, "seed": None if seeds is None else seeds[i]}
                for i in range(n)]
    return o.chat([[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}] for i in range(n)],
                  voice=[VOICES[i % 3] for i in range(n)], sampling=sampling, talker_sampling=talker_sampling)


def test_buckets_and_static_context() -> None:
    assert [batch_bucket(n, SIZES) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]
    assert [width_bucket(n, 12) for n in (1, 2, 3, 4, 5, 8, 9, 16)] == [1, 2, 4, 4, 8, 8, 12, 12]
    assert [width_bucket(n, 12, 4) for n in (1, 3, 5, 16)] == [4, 4, 8, 12]  # short contexts reuse width 4
    tables, computed = [[3, 7, 1], [5, 2]], [9, 4]
    static = StaticDecodeContext(4, 6, BLOCK, 9, "cpu")
    static.fill(computed, tables, 4, 4)
    ctx, ref = static.context(4, 4), build_context(computed, [1, 1], tables, BLOCK)
    assert ctx.slot_mapping.tolist() == ref.slot_mapping.tolist() + [36, 36] == [5, 8, 36, 36]
    assert ctx.context_lens.tolist() == [10, 5, 1, 1] and ctx.max_seqlen_k == 16 and not ctx.is_prefill
    assert ctx.block_tables.tolist() == [[3, 7, 1, 9], [5, 2, 9, 9], [9] * 4, [9] * 4]
    # the live rows attend exactly as with the engine's own context; padding rows read the scratch slot only
    torch.manual_seed(0)
    k_cache, v_cache = torch.randn(2, 10, BLOCK, 2, 8).unbind(0)
    q = torch.randn(4, 4, 8)
    out = paged_decode_attention(q, k_cache, v_cache, ctx, 0.3)
    torch.testing.assert_close(out[:2], paged_decode_attention(q[:2], k_cache, v_cache, ref, 0.3),
                               atol=1e-6, rtol=0)
    assert torch.equal(out[2:], v_cache[9, 0][None].repeat_interleave(2, 1).expand(2, 4, 8))


@pytest.mark.parametrize("graphs", [None, EmulatedGraphs])
def test_greedy_codes_and_audio_equal_the_eager_engine(graphs) -> None:
    frames = [7, 12, 18, 23, 30, 9]
    talker = [{"temperature": 0, "max_frames": f, "ignore_eos": True} for f in frames]
    eager = chat(omni(False), 6, talker)
    stage = omni(True).engine.talkers[0]
    scratch = stage.runner.context.scratch
    for layer in stage.talker.model.layers:  # a finite sentinel: live rows never attend to the scratch block
        layer.self_attn.attn.k_cache[scratch].fill_(7.0)
        layer.self_attn.attn.v_cache[scratch].fill_(7.0)
    stage.runner.graphs = graphs and graphs()
    try:
        with spy(omni(True)) as steps:
            ran = chat(omni(True), 6, talker)
    finally:
        stage.runner.graphs = None
    for a, b, f in zip(ran, eager, frames):
        assert a.codes.shape == (16, f) and np.array_equal(a.codes, b.codes) and a.token_ids == b.token_ids
        # NOTE: code2wav batches requests as they come (thread timing), which moves its float sums by ~1e-7
        np.testing.assert_allclose(a.audio, b.audio, rtol=0, atol=1e-6)
    assert len(steps) >= 20
    assert any(b > n for n, b, _ in steps)  # padded batches
    assert len({b for _, b, _ in steps}) >= 3 and len({w for _, _, w in steps}) >= 2  # buckets crossed
    # padding rows (zero input: zero k, v) wrote slot 0 of the scratch block, and nothing else there
    written = kv(omni(True))[:, :, scratch]
    assert not written[:, :, 0].any() and bool((written[:, :, 1:] == 7.0).all())


def request_kv(o: Omni, run) -> tuple[list, torch.Tensor]:
    """`run()`'s results and the KV rows of its one request (the cache zeroed first: rows it did not
    write stay zero), through the block table the talker grew for it (one list, kept past its release)."""
    stage = o.engine.talkers[0]
    tables: dict[str, list[int]] = {}
    allocate = stage.blocks.allocate
    stage.blocks.allocate = lambda seq_id, n: tables.setdefault(seq_id, allocate(seq_id, n))
    for layer in stage.talker.model.layers:
        layer.self_attn.attn.k_cache.zero_()
        layer.self_attn.attn.v_cache.zero_()
    try:
        results = run()
    finally:
        del stage.blocks.allocate
    (table,) = tables.values()
    return results, kv(o)[:, :, table].flatten(2, 3)


def test_one_request_across_width_buckets_writes_the_eager_kv() -> None:
    # alone (17 prompt rows), a request's own context crosses the width buckets' edges: at 32 cached rows
    # the new row opens block 9, so the step gathers 16 blocks, at 64 it gathers 32
    long = [{"temperature": 0, "max_frames": 52, "ignore_eos": True}]
    eager, eager_kv = request_kv(omni(False), lambda: chat(omni(False), 1, long))
    with spy(omni(True)) as steps:
        ran, ran_kv = request_kv(omni(True), lambda: chat(omni(True), 1, long))
    assert {w for _, _, w in steps} == {8, 16, 32} and np.array_equal(ran[0].codes, eager[0].codes)
    rows = ran_kv.flatten(3).any(-1).any(0).any(0)
    assert rows.sum() == 17 + 52 - 1 and bool(rows[:68].all())  # prompt + every frame's row but the last
    torch.testing.assert_close(ran_kv, eager_kv, atol=1e-5, rtol=0)  # measured: 7.2e-7


def test_seeded_sampling_equals_the_eager_engine() -> None:
    talker = [{"max_frames": 14, "ignore_eos": True},  # temperature 0.9, top-k 50, repetition penalty
              {"temperature": 1.0, "top_k": 0, "max_frames": 11, "ignore_eos": True},  # no truncation
              {"temperature": 0, "max_frames": 16, "ignore_eos": True},
              {"temperature": 0.7, "top_p": 0.8, "max_frames": 13, "ignore_eos": True},
              {"max_frames": 20, "ignore_eos": True}]
    seeds = [11, 12, 13, 14, 15]
    eager = chat(omni(False), 5, talker, seeds)
    with spy(omni(True)) as steps:
        ran = chat(omni(True), 5, talker, seeds)
    assert len(steps) >= 10
    for a, b in zip(ran, eager):
        assert np.array_equal(a.codes, b.codes)
        np.testing.assert_allclose(a.audio, b.audio, rtol=0, atol=1e-6)
    greedy = chat(omni(False), 5, [{**t, "temperature": 0} for t in talker], seeds)
    assert not np.array_equal(ran[0].codes, greedy[0].codes)  # the sampled rows did sample


def test_aborts_free_everything() -> None:
    o = omni(True)
    stage = o.engine.talkers[0]
    total = stage.blocks.num_blocks
    assert total == omni(False).engine.talkers[0].blocks.num_blocks - 1 == 127  # one block reserved
    rng = random.Random(0)
    add_and_abort(o.engine, 40, lambda i: o.engine.make_request(
        f"g{i}", [{"role": "user", "content": PROMPTS[i % 6]}], None, want_audio=True, voice=VOICES[i % 3],
        emit=lambda d: None, sampling={"temperature": 0, "max_tokens": rng.randint(1, 8)},
        talker_sampling={"temperature": 0, "max_frames": rng.randint(1, 30)}), rng, 0.4)
    e = o.engine

    def all_free() -> None:
        assert not e.requests and e.thinker.blocks.num_used == 0 and not e.thinker.running
        assert stage.blocks.num_used == 0 and not stage.seqs and len(stage.blocks.free) == total
        for c in e.code2wavs:
            assert not c.seqs and len(c.streamer.cache.free_slots) == c.max_batch_size

    settle(all_free, 90)
    assert stage.runner.context.scratch not in stage.blocks.free  # still reserved, still out of the pool
    talker = [{"temperature": 0, "max_frames": 17, "ignore_eos": True}] * 2
    again, eager = chat(o, 2, talker), chat(omni(False), 2, talker)
    for a, b in zip(again, eager):
        assert np.array_equal(a.codes, b.codes)
        np.testing.assert_allclose(a.audio, b.audio, rtol=0, atol=1e-6)


def test_capture_at_start_then_replay() -> None:
    runner = omni(True).engine.talkers[0].runner
    runner.graphs = EmulatedGraphs()
    talker = [{"temperature": 0, "max_frames": f, "ignore_eos": True} for f in (11, 6)]
    try:
        runner.capture([5])  # every batch bucket: its head graph and its step graph at width 5 -> bucket 8
        assert set(runner.graphs.fns) == {("head", b) for b in SIZES} | {(b, 8) for b in SIZES}
        ran = chat(omni(True), 2, talker)
    finally:
        runner.graphs = None
    for a, b, f in zip(ran, chat(omni(False), 2, talker), (11, 6)):
        assert a.codes.shape == (16, f) and np.array_equal(a.codes, b.codes)
