"""Deploy `connector.idle_first_frame_alone` (pipeline/thinker/first_frame.py): a request alone has its second
decode step launched only once the talker made its first frame, with the same outputs; nothing is held with
another request in the thinker, or past an arrival or `HOLD_S`."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest

from omnistage.config_loader import default_deploy_config, load_deploy_config
from omnistage.entrypoints.omni import Omni
from omnistage.models.qwen3_omni.make_tiny import tiny_checkpoint
from omnistage.pipeline.connector import Inbox
from omnistage.pipeline.thinker import first_frame
from omnistage.pipeline.thinker.first_frame import alone_before_first_frame, wait_first_frame

CONV = [{"role": "user", "content": "Tell me about the sea and the sky."}]
GREEDY = dict(sampling={"temperature": 0, "max_tokens": 9},
              talker_sampling={"temperature": 0, "max_frames": 12, "ignore_eos": True})


def omni(alone: bool) -> Omni:
    d = tiny_checkpoint("tiny")
    overrides = {"connector": {"idle_first_frame_alone": alone}}
    return Omni(d, deploy=load_deploy_config(default_deploy_config(d), platform="cpu", overrides=overrides),
                device="cpu")


def test_second_decode_waits_for_the_first_frame(monkeypatch) -> None:
    monkeypatch.setattr(first_frame, "HOLD_S", 30.0)  # NOTE: the CPU's talker is slow; the hold must not end first
    off, on = omni(False), omni(True)
    thinker = on.engine.thinker
    assert thinker.hold_first_frame and not off.engine.thinker.hold_first_frame
    launch, seen = thinker._launch, []

    def watch(batch):
        seen.extend("first_frame" in s.req.phases for s, _ in batch if not s.in_prefill and s.num_sampled == 1)
        return launch(batch)

    thinker._launch = watch
    try:
        a, b = off.chat(CONV, **GREEDY), on.chat(CONV, **GREEDY)
    finally:
        on.engine.shutdown()
        off.engine.shutdown()
    assert seen == [True]  # the second token's step, launched once
    assert a.token_ids == b.token_ids and len(b.token_ids) == 9
    assert np.array_equal(a.codes, b.codes) and b.codes.shape == (16, 12) and np.array_equal(a.audio, b.audio)


def stage(*seqs, waiting=(), inbox=0) -> SimpleNamespace:
    box = Inbox()
    for _ in range(inbox):
        box.put(object())
    return SimpleNamespace(running=list(seqs), waiting=list(waiting), queued=[], arrivals=[], inbox=box)


def seq(audio: bool = True, sampled: int = 1, prefill: bool = False, framed: bool = False) -> SimpleNamespace:
    req = SimpleNamespace(want_audio=audio, phases={"first_frame": 0.1} if framed else {})
    return SimpleNamespace(req=req, num_sampled=sampled, in_prefill=prefill)


@pytest.mark.parametrize("case,held", [
    (lambda: stage(seq()), True),
    (lambda: stage(seq(), seq()), False),  # another request: its talker needs the thinker's next token
    (lambda: stage(seq(), waiting=[seq(prefill=True)]), False),
    (lambda: stage(seq(), inbox=1), False),
    (lambda: stage(seq(audio=False)), False),
    (lambda: stage(seq(sampled=2)), False),  # only the second token's step
    (lambda: stage(seq(prefill=True, sampled=0)), False),
    (lambda: stage(seq(framed=True)), False),
])
def test_held_only_for_a_request_alone(case, held: bool) -> None:
    s = case()
    assert (alone_before_first_frame(s) is s.running[0].req if held else alone_before_first_frame(s) is None)


def test_the_hold_ends_at_an_arrival_an_abort_or_its_limit(monkeypatch) -> None:
    monkeypatch.setattr(first_frame, "HOLD_S", 0.05)
    req = SimpleNamespace(phases={}, aborted=False)
    box = Inbox()
    box.put(object())
    t = time.perf_counter()
    wait_first_frame(req, box)
    req.aborted = True
    wait_first_frame(req, Inbox())
    assert time.perf_counter() - t < 0.02
    req.aborted = False
    t = time.perf_counter()
    wait_first_frame(req, Inbox())
    assert 0.05 <= time.perf_counter() - t < 0.5
