"""The staged engine: streaming exactness, thinker/talker pacing, aborts, concurrency, seeds."""

from __future__ import annotations

import functools
import gc
import random
import time
import weakref

import numpy as np
import pytest
import torch

from omnistage.config_loader import default_deploy_config, load_deploy_config
from omnistage.entrypoints.omni import ChatResult, Omni
from omnistage.models.qwen3_omni.make_tiny import tiny_checkpoint

from graph_helpers import add_and_abort, packet_sizes, settle

PROMPTS = ["Say hello.", "Tell me about the sea and the sky.", "Why?", "One, two, three, four, five."]


@functools.cache
def omni(initial: int = 4, chunk: int = 25, replicas: int = 1, growth: bool = True, idle: int = 0) -> Omni:
    d = tiny_checkpoint("tiny")
    overrides = {"connector": {"initial_codec_chunk_frames": initial, "codec_chunk_frames": chunk,
                               "codec_chunk_growth": growth, "idle_initial_codec_chunk_frames": idle},
                 "stages": {"talker": {"replicas": replicas}, "code2wav": {"replicas": replicas}}}
    return Omni(d, deploy=load_deploy_config(default_deploy_config(d), platform="cpu", overrides=overrides),
                device="cpu")


def conv(i: int) -> list[dict]:
    return [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]


def greedy(tokens: int, frames: int) -> dict:
    return dict(sampling={"temperature": 0, "max_tokens": tokens},
                talker_sampling={"temperature": 0, "max_frames": frames, "ignore_eos": True})


@pytest.mark.parametrize("initial,chunk,growth,idle", [(1, 7, False, 0), (2, 25, True, 0), (4, 3, True, 0),
                                                       (4, 25, True, 0), (2, 25, True, 1)])
def test_stream_chunks_are_sample_exact(initial: int, chunk: int, growth: bool, idle: int) -> None:
    """A request alone: packets as the schedule says (with `idle`, its first packet `idle` frames), exact."""
    o = omni(initial, chunk, growth=growth, idle=idle)
    deltas = []
    req = o.engine.make_request("r", conv(1), None, want_audio=True, voice="Aiden", emit=deltas.append,
                                **greedy(8, 33))
    o.engine.add_request(req)
    o.engine.wait(["r"])
    chunks = [d for d in deltas if d.audio is not None]
    frames = [d.codes.shape[1] for d in chunks]
    assert frames == packet_sizes(33, idle or initial, chunk, growth)  # (2, 25, True): 2, 2, 4, 8, 16, 1
    assert [len(d.audio) for d in chunks] == [f * 1920 - (555 if i == 0 else 0) for i, f in enumerate(frames)]
    codes = np.concatenate([d.codes for d in chunks], 1)
    with torch.no_grad():
        whole = o.engine.code2wavs[0].streamer.model(torch.tensor(codes)[None])[0, 0].numpy()
    streamed = np.concatenate([d.audio for d in chunks])
    assert streamed.shape == whole.shape == (33 * 1920 - 555,)
    assert float(np.abs(streamed - whole).max()) < 1e-5


def test_talker_waits_for_a_slow_thinker() -> None:
    o = omni()
    expected = o.chat(conv(1), **greedy(12, 20))
    thinker = o.engine.thinker
    fast_step = thinker.step

    def slow_step() -> bool:
        time.sleep(0.03)
        return fast_step()

    thinker.step = slow_step
    try:
        slow = o.chat(conv(1), **greedy(12, 20))
    finally:
        del thinker.step
    assert slow.token_ids == expected.token_ids
    assert np.array_equal(slow.codes, expected.codes)


def _all_free(o: Omni) -> None:
    e = o.engine
    assert e.thinker.blocks.num_used == 0 and not e.thinker.running and not e.thinker.waiting
    for t in e.talkers:
        assert t.blocks.num_used == 0 and not t.seqs
    for c in e.code2wavs:
        assert not c.seqs and len(c.streamer.cache.free_slots) == c.max_batch_size
    assert e.routing.talker.load == [0] * len(e.talkers) and e.routing.code2wav.load == [0] * len(e.code2wavs)
    assert not e.requests


@pytest.mark.parametrize("replicas", [1, 2])
def test_random_aborts_free_everything(replicas: int) -> None:
    o = omni(replicas=replicas)
    reference = o.chat(conv(2), **greedy(6, 12))
    rng = random.Random(0)
    add_and_abort(o.engine, 100, lambda i: o.engine.make_request(
        f"a{i}", conv(i), None, want_audio=i % 5 != 0, voice="Ethan", emit=lambda d: None,
        **greedy(rng.randint(1, 12), rng.randint(1, 30))), rng, 0.3)
    settle(lambda: _all_free(o), 90)
    again = o.chat(conv(2), **greedy(6, 12))
    assert again.token_ids == reference.token_ids and np.array_equal(again.codes, reference.codes)
    np.testing.assert_array_equal(again.audio, reference.audio)


def test_64_mixed_requests() -> None:
    o = omni()
    voices = ["Ethan", "Chelsie", "Aiden"]
    n = 64
    audio = [i % 4 != 3 for i in range(n)]
    results = [ChatResult() for _ in range(n)]
    frames = [3 + i % 9 for i in range(n)]
    for i in range(n):
        req = o.engine.make_request(f"m{i}", conv(i), None, want_audio=audio[i], voice=voices[i % 3],
                                    emit=results[i].add, **greedy(2 + i % 5, frames[i]))
        o.engine.add_request(req)
    o.engine.wait([f"m{i}" for i in range(n)])
    for i, r in enumerate(results):
        assert len(r.token_ids) <= 2 + i % 5 and r.finish_reason in ("stop", "length")
        if audio[i]:
            assert r.codes.shape == (16, frames[i]) and len(r.audio) == frames[i] * 1920 - 555
            assert (r.codes < 2048).all()  # ignore_eos: codec_eos is suppressed, never sent to code2wav
        else:
            assert r.audio is None
    for i in (0, 1, 2, 5):  # the voice (and everything else) of a request equals its run alone
        alone = o.chat(conv(i), voice=voices[i % 3], **greedy(2 + i % 5, frames[i]))
        assert alone.token_ids == results[i].token_ids and np.array_equal(alone.codes, results[i].codes)


def test_seed_reproducible_through_all_stages() -> None:
    o = omni()
    sampled = dict(sampling={"temperature": 0.8, "top_p": 0.9, "max_tokens": 8, "seed": 1234},
                   talker_sampling={"max_frames": 10, "ignore_eos": True})
    a = o.chat(conv(0), **sampled)
    batch = o.chat([conv(3), conv(0), conv(1)], sampling=[{"temperature": 1.0, "max_tokens": 5}, sampled["sampling"],
                                                           {"temperature": 0, "max_tokens": 3}],
                   talker_sampling=sampled["talker_sampling"])
    assert batch[1].token_ids == a.token_ids and np.array_equal(batch[1].codes, a.codes)
    other = o.chat(conv(0), sampling={**sampled["sampling"], "seed": 99}, talker_sampling=sampled["talker_sampling"])
    assert other.token_ids != a.token_ids or not np.array_equal(other.codes, a.codes)


def test_stop_strings_and_stop_token_ids() -> None:
    o = omni()
    full = o.chat(conv(1), modalities=["text"], sampling={"temperature": 0, "max_tokens": 12})
    assert full.finish_reason == "length" and len(full.token_ids) == 12
    cut = full.token_ids[4]
    by_id = o.chat(conv(1), modalities=["text"], sampling={"temperature": 0, "max_tokens": 12, "stop_token_ids": [cut]})
    assert by_id.token_ids == full.token_ids[:5] and by_id.finish_reason == "stop"
    stop = full.text[len(full.text) // 2:][:3]
    by_text = o.chat(conv(1), modalities=["text"], sampling={"temperature": 0, "max_tokens": 12, "stop": [stop]})
    assert by_text.finish_reason == "stop" and by_text.text == full.text[:full.text.index(stop)]


def test_request_larger_than_the_kv_cache_is_refused() -> None:
    o = omni()
    room = o.engine.thinker.blocks.capacity
    with pytest.raises(ValueError, match="exceeds the thinker's KV cache"):
        o.chat(conv(0), sampling={"max_tokens": room})
    with pytest.raises(ValueError, match="exceeds the talker's KV cache"):
        o.chat(conv(0), talker_sampling={"max_frames": o.engine.talkers[0].blocks.capacity})
    assert o.engine.stats()["thinker"]["kv_blocks_used"] == 0


def test_replicas_share_the_load_and_match_one_replica() -> None:
    one, two = omni(), omni(replicas=2)
    convs = [conv(i) for i in range(6)]
    kw = dict(voice=["Ethan", "Aiden", "Chelsie"] * 2, sampling={"temperature": 0, "max_tokens": 5},
              talker_sampling={"temperature": 0, "max_frames": 9})
    counts = [0, 0]
    stages = two.engine.talkers
    steps = [s.step for s in stages]
    for i, s in enumerate(stages):
        s.step = lambda i=i: (counts.__setitem__(i, counts[i] + (stages[i].num_active > 0)) or steps[i]())
    try:
        a, b = one.chat(convs, **kw), two.chat(convs, **kw)
    finally:
        for s in stages:
            del s.step
    assert counts[0] > 0 and counts[1] > 0  # both talker replicas did work
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids and np.array_equal(x.codes, y.codes)
        np.testing.assert_allclose(x.audio, y.audio, atol=1e-6)


def test_async_chunk_off_starts_the_talker_after_the_thinker() -> None:
    d = tiny_checkpoint("tiny")
    deploy = load_deploy_config(default_deploy_config(d), platform="cpu", overrides={"async_chunk": False})
    off, on = Omni(d, deploy=deploy, device="cpu"), omni()
    talker = off.engine.talkers[0]
    seen_text_done = []
    step = talker.step

    def watch() -> bool:
        seen_text_done.extend(s.thinker_done for s in talker.seqs.values())
        return step()

    talker.step = watch
    try:
        a = off.chat(conv(1), **greedy(9, 14))
    finally:
        off.engine.shutdown()
    b = on.chat(conv(1), **greedy(9, 14))
    assert seen_text_done and all(seen_text_done)
    assert a.token_ids == b.token_ids and np.array_equal(a.codes, b.codes)


def test_text_continues_after_the_audio_ends() -> None:
    """The talker may stop (max_frames, EOS) before the thinker: the stream ends only when both are done."""
    o = omni()
    text_only = o.chat(conv(1), modalities=["text"], sampling={"temperature": 0, "max_tokens": 14})
    both = o.chat(conv(1), sampling={"temperature": 0, "max_tokens": 14},
                  talker_sampling={"temperature": 0, "max_frames": 2})
    assert both.token_ids == text_only.token_ids and both.finish_reason == "length"
    assert both.codes.shape == (16, 2) and both.usage.completion_tokens == 14 and both.usage.audio_frames == 2


def test_stage_step_counters() -> None:
    o = omni(2, 5)  # its own engine: the counters start at zero
    before = o.engine.stats()
    o.chat(conv(0), **greedy(7, 13))
    after = o.engine.stats()
    d = {s: {k: after[s][k] - before[s][k] for k in ("steps", "step_rows", "busy_seconds")} for s in after}
    assert d["talker"]["steps"] == d["talker"]["step_rows"] == 13  # one frame per step: the prefill, 12 decodes
    assert d["thinker"]["steps"] == 7 and d["thinker"]["step_rows"] == 7  # whole prompt in one step + 6 decodes
    assert d["code2wav"]["step_rows"] == 4  # chunks of 2, 2, 4, 5 frames
    assert all(d[s]["busy_seconds"] > 0 for s in d)


def test_the_offline_api_keeps_the_stages_in_this_process() -> None:
    # a deploy config asking for a worker process (as the default one does on GPUs) still runs in-process: a
    # spawned worker would run the caller's script again unless it has an `if __name__ == "__main__":` guard
    d = tiny_checkpoint("tiny")
    o = Omni(d, deploy=load_deploy_config(default_deploy_config(d), "cpu", overrides={"placement": "pipeline"}),
             device="cpu")
    try:
        assert o.engine.placement == "local" and o.engine.thinker.blocks.num_blocks > 0
    finally:
        o.engine.shutdown()


def test_a_finished_request_is_freed_without_the_garbage_collector() -> None:
    """A request (its prompt inputs, media tensors among them) in a reference cycle waited for a collection: in
    a server, a pause of every stage's thread (gc_heap.py)."""
    o = omni(2, 25)
    gc.collect()
    gc.disable()
    try:
        req = o.engine.make_request("freed", conv(2), None, want_audio=True, voice="Aiden", emit=lambda d: None,
                                    **greedy(4, 6))
        o.engine.add_request(req)
        o.engine.wait(["freed"])
        ref = weakref.ref(req)
        del req

        def freed() -> None:  # NOTE: a stage's thread may hold it until its step in flight is done
            assert ref() is None
        settle(freed)
    finally:
        gc.enable()
