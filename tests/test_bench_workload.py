"""The read-aloud workload's requests: the prompt length they hit, the tag that keeps each prompt its own (unless
repeated), and the lengths a random-weight payload forces. (Against the tiny server, that a row then finds no earlier
row's prompt in the prefix cache: test_bench.py.)"""

from __future__ import annotations

import re

import pytest

from omnistage.bench.client import chat_payload
from omnistage.bench.workload import SYSTEM_PROMPT, build_requests, load_sentences, token_counter


@pytest.mark.parametrize("target", [10, 160, 640])
def test_workload_hits_the_prompt_length(target):
    counter = token_counter()
    reqs = build_requests(target, 12, 7, counter)
    for r in reqs:
        text = "".join(m["content"] for m in r.messages)
        assert r.prompt_tokens == target == sum(counter.count(m["content"]) for m in r.messages), text
        assert r.messages[-1]["content"].endswith(counter.truncate(r.sentence.text, target))
        assert (r.messages[0]["content"] == SYSTEM_PROMPT) == (target >= 160)
        assert r.text_tokens == counter.count(r.sentence.text)
        assert r.audio_frames == round(12.5 * r.sentence.duration_s)
    assert [r.sentence for r in reqs] == [r.sentence for r in build_requests(320, 12, 7, counter)]
    assert len({r.sentence for r in reqs}) == 12 and len(load_sentences()) == 1127


@pytest.mark.parametrize("target", [160, 640])
def test_no_request_shares_a_prefix_past_the_system_prompt_unless_repeated(target):
    counter = token_counter()
    users = [r.messages[-1]["content"] for r in build_requests(target, 6, 7, counter) +
             build_requests(target, 6, 7, counter) + build_requests(2 * target, 6, 7, counter)]
    assert all(re.match(r"\[\d{6}\] \S", u) for u in users), users  # each opens with its tag
    assert len({u[:8] for u in users}) == len(users)  # ... a tag of its own: the same rows built again too
    again = [build_requests(target, 6, 7, counter, repeat=True) for _ in range(2)]
    assert again[0] == again[1] and not again[0][0].messages[-1]["content"].startswith("[")
    assert [r.prompt_tokens for r in again[0]] == [target] * 6
    assert build_requests(10, 1, 7, counter)[0] == build_requests(10, 1, 7, counter, repeat=True)[0]  # no room


def test_payload_forces_lengths_only_with_random_weights():
    req = build_requests(160, 1, 0, token_counter())[0]
    forced = chat_payload(req, model="m", random_weights=True)
    assert forced["max_tokens"] == req.text_tokens and forced["ignore_eos"] is True
    assert forced["talker"] == {"max_frames": req.audio_frames, "ignore_eos": True}
    assert forced["stream"] and forced["stream_options"] == {"include_usage": True}
    assert forced["audio"] == {"voice": "Ethan", "format": "pcm16"} and forced["model"] == "m"
    capped = chat_payload(req, model=None, random_weights=True, max_tokens=3, max_frames=5)
    long = chat_payload(req, model=None, random_weights=True, answer_scale=5)
    assert long["max_tokens"] == 5 * req.text_tokens and long["talker"]["max_frames"] == 5 * req.audio_frames
    assert capped["max_tokens"] == 3 and capped["talker"]["max_frames"] == 5 and "model" not in capped
    free = chat_payload(req, model=None, random_weights=False)
    assert not {"max_tokens", "ignore_eos", "talker", "max_audio_frames"} & set(free)
