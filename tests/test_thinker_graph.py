"""The thinker's decode-step runner (static buffers, padded batch / KV-width buckets; CUDA graphs on CUDA)
against the eager engine, on the CPU: same tokens, codes and audio, padding rows confined to the scratch block."""

from __future__ import annotations

import functools
import random
from dataclasses import replace

import numpy as np
import torch

from omnistage.config_loader import default_deploy_config, load_deploy_config
from omnistage.entrypoints.omni import Omni
from omnistage.models.qwen3_omni.make_tiny import tiny_checkpoint
import graph_helpers
from graph_helpers import EmulatedGraphs, add_and_abort, settle

PROMPTS = ["Say hello.", "Tell me about the sea and the sky, then about the mountains and the rivers.", "Why?",
           "One, two, three, four, five.", "Name a colour.", "What is the capital of France?"]
SIZES = (1, 2, 4, 8)
BLOCK = 4  # small blocks: KV widths cross several buckets within a few dozen tokens


@functools.cache
def omni(graph: bool) -> Omni:
    d = tiny_checkpoint("tiny")
    # NOTE: 4 MiB (1024 blocks), not 64: the spy copies the whole KV cache at every forward
    small = {"stages": {"thinker": {"block_size": BLOCK, "kv_cache_memory": 1 << 22}}}
    cfg = load_deploy_config(default_deploy_config(d), platform="cpu", overrides=small)
    # NOTE: the deploy config refuses cuda_graph on the cpu platform; set past validation, it means
    # "runner on, graphs captured only on CUDA": the static-buffer path runs eagerly here.
    thinker = replace(cfg.stages.thinker, cuda_graph=graph, cuda_graph_batch_sizes=SIZES,
                        cuda_graph_capture_widths=(1,),  # every width bucket reachable
                        cuda_graph_prefill_tokens=())  # decode runner alone (tests/test_prefill_graph.py)
    return Omni(d, deploy=replace(cfg, stages=replace(cfg.stages, thinker=thinker)), device="cpu")


def spy(o: Omni):
    return graph_helpers.spy(o.engine.thinker.runner, o.engine.thinker.thinker.model, BLOCK, lambda seqs, tables, *_: {
        t[s.num_computed // BLOCK] * BLOCK + s.num_computed % BLOCK for s, t in zip(seqs, tables)})


def kv(o: Omni) -> torch.Tensor:
    return graph_helpers.kv(o.engine.thinker.thinker.model)


def chat(o: Omni, n: int, sampling: list[dict], audio: bool = True):
    return o.chat([[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}] for i in range(n)],
                  modalities=("text", "audio") if audio else ("text",), sampling=sampling,
                  talker_sampling={"temperature": 0, "max_frames": 18, "ignore_eos": True})  # > max_tokens


def test_greedy_tokens_and_codes_equal_the_eager_engine() -> None:
    sampling = [{"temperature": 0, "max_tokens": m, "ignore_eos": True} for m in (5, 16, 8, 12, 3, 14)]
    eager = chat(omni(False), 6, sampling)
    stage = omni(True).engine.thinker
    scratch = stage.runner.context.scratch
    for layer in stage.thinker.model.layers:  # a finite sentinel: live rows never attend to the scratch block
        layer.self_attn.attn.k_cache[scratch].fill_(7.0)
        layer.self_attn.attn.v_cache[scratch].fill_(7.0)
    with spy(omni(True)) as steps:
        ran = chat(omni(True), 6, sampling)
    for a, b, m in zip(ran, eager, (5, 16, 8, 12, 3, 14)):
        assert len(a.token_ids) == m and a.token_ids == b.token_ids and a.text == b.text
        assert np.array_equal(a.codes, b.codes)
        np.testing.assert_allclose(a.audio, b.audio, rtol=0, atol=1e-6)
    assert len(steps) >= 12
    assert any(b > n for n, b, _ in steps)  # padded batches
    assert len({b for _, b, _ in steps}) >= 3 and len({w for _, _, w in steps}) >= 2  # buckets crossed
    written = kv(omni(True))[:, :, scratch]  # padding rows feed token 0: they wrote slot 0 of the scratch block
    assert written[:, :, 0].ne(7.0).all() and bool((written[:, :, 1:] == 7.0).all())


def test_seeded_sampling_equals_the_eager_engine() -> None:
    base = {"temperature": 0.8, "top_p": 0.9, "repetition_penalty": 1.1, "presence_penalty": 0.5,
            "ignore_eos": True}
    sampling = [{**base, "max_tokens": 8, "seed": 1}, {"temperature": 0, "max_tokens": 12, "ignore_eos": True},
                {**base, "max_tokens": 14, "seed": 2}, {**base, "max_tokens": 6, "seed": 3, "top_p": 1.0},
                {**base, "max_tokens": 10, "seed": 4, "repetition_penalty": 1.0},
                # NOTE: the random tiny model never picks a seen token by itself: only penalties that favour
                # seen tokens (prompt ones through `seen`, output ones through `counts`) change its tokens
                {"temperature": 0, "max_tokens": 9, "repetition_penalty": 0.5, "ignore_eos": True},
                {**base, "max_tokens": 11, "seed": 5, "repetition_penalty": 1.0, "frequency_penalty": -8.0}]
    eager = chat(omni(False), 7, sampling, audio=False)
    with spy(omni(True)) as steps:
        ran = chat(omni(True), 7, sampling, audio=False)
    assert len(steps) >= 8
    for a, b in zip(ran, eager):
        assert a.token_ids == b.token_ids
    greedy = chat(omni(False), 7, [{**s, "temperature": 0} for s in sampling], audio=False)
    assert ran[0].token_ids != greedy[0].token_ids and ran[2].token_ids != greedy[2].token_ids  # they sampled
    plain = chat(omni(False), 7, [{**s, "repetition_penalty": 1.0, "frequency_penalty": 0.0} for s in sampling],
                 audio=False)
    assert ran[5].token_ids != plain[5].token_ids and ran[6].token_ids != plain[6].token_ids  # penalties bit


def test_aborts_free_everything() -> None:
    o = omni(True)
    stage = o.engine.thinker
    total = stage.blocks.num_blocks
    assert total == omni(False).engine.thinker.blocks.num_blocks - 1  # one block reserved
    rng = random.Random(0)
    add_and_abort(o.engine, 30, lambda i: o.engine.make_request(
        f"t{i}", [{"role": "user", "content": PROMPTS[i % 6]}], None, want_audio=i % 2 == 0, voice="Ethan",
        emit=lambda d: None, sampling={"temperature": 0, "max_tokens": rng.randint(1, 20)},
        talker_sampling={"temperature": 0, "max_frames": rng.randint(1, 10)}), rng, 0.4)

    def all_free() -> None:
        assert not o.engine.requests and stage.blocks.num_used == 0 and not stage.running and not stage.waiting

    settle(all_free, 90)
    assert len(stage.blocks.free) == total and stage.runner.context.scratch not in stage.blocks.free
    sampling = [{"temperature": 0, "max_tokens": 11, "ignore_eos": True}] * 2
    again, eager = chat(o, 2, sampling, audio=False), chat(omni(False), 2, sampling, audio=False)
    assert [a.token_ids for a in again] == [b.token_ids for b in eager]


def test_capture_protocol_with_emulated_graphs() -> None:
    # what the static buffers hold at warm-up, capture (padding rows only) and replay, as on CUDA; past the
    # widths captured at start the steps run eagerly (nothing is captured mid-serving); without any captured
    # at start, each width is captured when first needed
    sampling = [{"temperature": 0, "max_tokens": m, "ignore_eos": True} for m in (4, 9, 6)]
    runner = omni(True).engine.thinker.runner
    want = [b.token_ids for b in chat(omni(False), 3, sampling, audio=False)]
    try:
        runner.graphs = EmulatedGraphs()
        runner.capture([3])  # at start: every batch bucket at width 3 -> bucket 4 (BLOCK 4: 9..16 tokens)
        assert set(runner.graphs.fns) == {(b, 4) for b in SIZES}
        ran = chat(omni(True), 3, sampling, audio=False)
        assert set(runner.graphs.fns) == {(b, 4) for b in SIZES}
        runner.graphs, runner.min_width, runner.max_captured = EmulatedGraphs(), 1, 0
        lazy = chat(omni(True), 3, sampling, audio=False)
        keys = set(runner.graphs.fns)
    finally:
        runner.graphs, runner.min_width, runner.max_captured = None, 1, 0
    assert [a.token_ids for a in ran] == want == [a.token_ids for a in lazy]
    assert {w for _, w in keys} >= {8, 16}  # what the first run decoded eagerly
