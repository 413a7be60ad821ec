"""The thinker's media budget per step (`max_num_encoder_input_tokens`, pipeline/thinker/arrivals.py): a step
takes what arrived in order while its media tokens fit, the rest in the next steps, with the same answers."""

from __future__ import annotations

import functools
import time
from collections import deque
from dataclasses import replace

import numpy as np
from mm_samples import TINY, image, video

from omnistage.config_loader import default_deploy_config, load_deploy_config
from omnistage.entrypoints.omni import Omni
from omnistage.models.qwen3_omni.make_tiny import tiny_checkpoint
from omnistage.pipeline.thinker.arrivals import take_within


def test_a_step_takes_items_in_order_while_their_media_tokens_fit() -> None:
    queue = deque([("text", 0), ("photo", 5), ("clip", 3), ("text 2", 0), ("video", 9), ("text 3", 0)])
    assert take_within(queue, 8) == ["text", "photo", "clip", "text 2"]  # 8 of 8; the video waits, and after it
    assert take_within(queue, 8) == ["video"]  # over the budget alone: the first item always goes
    assert take_within(queue, 8) == ["text 3"] and not queue
    queue.extend([("a", 7), ("b", 9)])
    assert take_within(queue, 0) == ["a", "b"]  # no budget: everything


@functools.cache
def omni(budget: int) -> Omni:
    d = tiny_checkpoint("tiny")
    cfg = load_deploy_config(default_deploy_config(d), platform="cpu")
    thinker = replace(cfg.stages.thinker, max_num_encoder_input_tokens=budget)
    return Omni(d, deploy=replace(cfg, stages=replace(cfg.stages, thinker=thinker)), device="cpu")


def spy_takes(stage, burst: int) -> list[int]:
    """The requests each step takes; the first step held until the whole burst waits (inbox and queue)."""
    taken, encode = [], stage._encode

    def spied(items):
        deadline = time.monotonic() + 30
        while not taken and len(items) + len(stage.queued) + len(stage.inbox) < burst and time.monotonic() < deadline:
            time.sleep(0.01)
        taken.append(len(items))
        return encode(items)

    stage._encode = spied
    return taken


def test_a_burst_is_encoded_over_several_steps_with_the_same_answers() -> None:
    convs = [[{"role": "user", "content": [{"type": "image", "image": image(10 + i)}, "What is this?"]}]
             for i in range(2)]
    convs += [[{"role": "user", "content": [{"type": "video", "video": video(30, 6, 3.0), **TINY}, "Hm?"]}],
              [{"role": "user", "content": "Just text."}]]
    kw = dict(sampling={"temperature": 0, "max_tokens": 5}, talker_sampling={"temperature": 0, "max_frames": 6})
    outs, takes = {}, {}
    for budget in (1, 0):
        stage = omni(budget).engine.thinker
        takes[budget] = spy_takes(stage, len(convs))
        try:
            outs[budget] = omni(budget).chat(convs, **kw)
        finally:
            del stage._encode
        assert stage.num_active == 0 and not stage.queued
    assert takes[1] == [1, 1, 1, 1]  # each media request over the budget alone; the text one after the video
    assert len(takes[0]) <= 2 and sum(takes[0]) == 4  # no budget: all that waited in one step
    for a, b in zip(outs[1], outs[0]):
        assert a.token_ids == b.token_ids and np.array_equal(a.codes, b.codes)
        np.testing.assert_allclose(a.audio, b.audio, atol=1e-5)
