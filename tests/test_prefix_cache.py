"""The prefix cache (engine/block_manager.py, pipeline/thinker/prefix.py) and the encoder cache
(pipeline/thinker/encoder_cache.py): the bookkeeping alone, then a conversation's second turn through an
engine that has the first turn cached against one that has no caches (greedy, fp32, CPU): the same tokens,
codes and audio, with the history's blocks and media taken from the caches."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from mm_samples import image, tone

from omnistage.config_loader import default_deploy_config, load_deploy_config
from omnistage.engine.block_manager import BlockManager
from omnistage.engine.prefix_hash import block_hashes
from omnistage.entrypoints.omni import Omni
from omnistage.models.qwen3_omni.make_tiny import tiny_checkpoint


def test_blocks_are_shared_kept_after_release_and_evicted_least_recent_first() -> None:
    bm = BlockManager(4, 2, extra_capacity=64)
    hashes = block_hashes([1, 2, 3, 4, 5], 2)
    assert len(hashes) == 2 and hashes == block_hashes([1, 2, 3, 4, 9], 2)
    table = bm.allocate("a", 5)
    bm.register("a", hashes, [torch.ones(2, 4), None])  # 32 bytes beside block 0
    assert bm.match("b", hashes, 4) == table[:2] and bm.refs[table[0]] == 2 and bm.extra_bytes == 32
    bm.release("a")
    assert bm.num_used == 2 and bm.refs[table[2]] == 0  # b still holds the shared two
    bm.release("b")
    assert bm.num_used == 0 and set(bm.cached.values()) == set(table[:2])
    # the unhashed block is reused first, then the least recently freed cached ones
    assert bm.allocate("c", 2) == [table[2]] and bm.cached
    bm.allocate("c", 8)
    assert not bm.cached and bm.extra_bytes == 0 and bm.match("d", hashes, 4) == []
    assert (bm.queries, bm.hits) == (8, 4)


def test_match_stops_at_max_tokens_and_register_at_extra_capacity() -> None:
    bm = BlockManager(8, 2, extra_capacity=16)
    hashes = block_hashes(range(6), 2)
    bm.allocate("a", 6)
    bm.register("a", hashes, [None, torch.ones(2, 2), torch.ones(2, 2)])  # the third passes 16 bytes
    assert len(bm.cached) == 2
    assert len(bm.match("b", hashes, 3)) == 1 and len(bm.match("c", hashes, 6)) == 2


def test_media_keys_enter_the_hash_from_the_block_where_their_placeholders_start() -> None:
    ids = list(range(10))
    a, b = block_hashes(ids, 4, [(5, 7, b"x")]), block_hashes(ids, 4, [(5, 7, b"y")])
    assert a[0] == b[0] and a[1] != b[1]


def test_visual_keys_follow_the_decoded_pixels_and_options() -> None:
    from PIL import Image

    from omnistage.models.qwen3_omni.media_keys import source_key
    from omnistage.models.qwen3_omni.prompt import PromptProcessor

    proc = PromptProcessor(tiny_checkpoint("tiny"))
    pic = np.asarray(image(5, 30, 44))
    keys = lambda im, **o: proc([{"role": "user", "content": [{"type": "image", "image": im, **o}, "?"]}]).media_keys
    same = keys(image(5, 30, 44))
    assert same.images == keys(image(5, 30, 44)).images == (source_key("image", pic, {}),)
    nudged = pic.copy()
    nudged[0, 0, 0] ^= 1
    assert keys(Image.fromarray(nudged)).images != same.images  # one bit of one pixel
    assert keys(image(5, 30, 44), max_pixels=32 * 32).images != same.images  # other patches from the same pixels
    assert source_key("video", pic[None], {}) != source_key("image", pic[None], {})
    assert same.spans[0][2] == same.images[0]


@pytest.fixture(scope="module")
def engines():
    d = tiny_checkpoint("tiny")
    cfg = load_deploy_config(default_deploy_config(d), platform="cpu")
    made = {on: Omni(d, deploy=replace(cfg, enable_prefix_caching=on, encoder_cache_mb=64 if on else 0),
                     device="cpu") for on in (True, False)}
    yield made
    for o in made.values():
        o.engine.shutdown()


def _turns(answer: str) -> tuple[list, list]:
    first = [{"role": "system", "content": "You are a helpful voice."},
             {"role": "user", "content": [{"type": "image", "image": image(3, 30, 44)},
                                          {"type": "audio", "audio": tone(1.3)}, "What do you see and hear?"]}]
    return first, [*first, {"role": "assistant", "content": answer},
                   {"role": "user", "content": [{"type": "audio", "audio": tone(0.8)}, "And this?"]}]


def test_second_turn_from_the_caches_equals_no_caches(engines) -> None:
    sampling, talker = {"temperature": 0, "max_tokens": 6}, {"temperature": 0, "max_frames": 8}
    cached, plain = engines[True], engines[False]
    first, _ = _turns("")
    answer = cached.chat(first, sampling=sampling, talker_sampling=talker)
    _, second = _turns(answer.text)
    stage = cached.engine.thinker
    before = stage.stats()
    got = cached.chat(second, sampling=sampling, talker_sampling=talker)
    want = plain.chat(second, sampling=sampling, talker_sampling=talker)
    after = stage.stats()
    assert got.token_ids == want.token_ids and np.array_equal(got.codes, want.codes)
    np.testing.assert_array_equal(got.audio, want.audio)
    prompt = cached.engine.processor(second)
    hit = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    # the history up to the assistant's answer: the system turn, the image, the first audio
    first_ids = cached.engine.processor(first).input_ids
    assert hit == (len(first_ids) - 1) // 16 * 16 and hit >= 32 and hit < len(prompt.input_ids)
    assert after["encoder_cache_hits"] - before["encoder_cache_hits"] == 2  # the image and the first audio
    assert "prefix_cache_hits" in plain.engine.thinker.stats() and plain.engine.thinker.stats()[
        "prefix_cache_hits"] == 0 and plain.engine.thinker.encoder_cache is None


def test_the_talker_takes_the_history_user_rows_from_its_cache(engines) -> None:
    """The second turn's talker prompt holds the first turn's user rows: its blocks whose thinker prefix was
    final in the first prompt come from the talker's prefix cache (pipeline/talker/prefix.py); under another
    system turn (the thinker computed those rows under it) none do. Both answer as an engine without caches."""
    from omnistage.pipeline.talker.prefix import prompt_hashes

    sampling, talker = {"temperature": 0, "max_tokens": 6}, {"temperature": 0, "max_frames": 8}
    cached, plain = engines[True], engines[False]
    stage = cached.engine.talkers[0]

    def keys(conv: list) -> list[bytes]:
        p = cached.engine.processor(conv)
        return prompt_hashes(torch.tensor(p.input_ids), p, stage.tokens, stage.blocks.block_size, True)

    def under(system: str, conv: list) -> list:  # a system turn of this test's: no other test's blocks
        return [{"role": "system", "content": system}, *conv[1:]]

    first = under("You are a kind voice.", _turns("")[0])
    answer = cached.chat(first, sampling=sampling, talker_sampling=talker).text
    second, other = (under(system, _turns(answer)[1]) for system in ("You are a kind voice.", "You are terse."))
    common = next(i for i, (a, b) in enumerate(zip([*keys(first), None], keys(second))) if a != b)
    assert 0 < common < len(keys(second))
    for conv, hit in ((second, common * stage.blocks.block_size), (other, 0)):
        before = stage.stats()["prefix_cache_hits"]
        got = cached.chat(conv, sampling=sampling, talker_sampling=talker)
        assert stage.stats()["prefix_cache_hits"] - before == hit
        want = plain.chat(conv, sampling=sampling, talker_sampling=talker)
        assert got.token_ids == want.token_ids and np.array_equal(got.codes, want.codes)
        np.testing.assert_array_equal(got.audio, want.audio)
