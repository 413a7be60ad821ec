"""Streaming input (`Orchestrator.open_request`) in a conversation and beside the engine's other work: earlier
audio in the prompt (padded as the whole prompt pads it, or rebased where the turn pauses), the prefix cache,
a turn too short to stream, the exact clip at close, another request decoding, abort, and the async API; each
answer equal to the whole clip's (greedy, fp32, CPU, tiny checkpoint). Helpers and the clip:
test_prompt_stream.py."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from test_prompt_stream import (
    HISTORY,
    SAMPLING,
    TALKER,
    assert_same,
    omni,
    speech,
    streamed,
    user,
    wait_prefilled,
    whole,
)

from omnistage.config_loader import default_deploy_config, load_deploy_config
from omnistage.entrypoints.omni import ChatResult
from omnistage.models.qwen3_omni.make_tiny import tiny_checkpoint

def history(samples: int) -> list[dict]:
    return [*HISTORY, {"role": "user", "content": [{"type": "audio", "audio": speech()[-samples:]}, "Hi."]},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "And this?"}]


@pytest.mark.parametrize("earlier", [40000, 12 * 16000])  # shorter / longer than the streamed audio
def test_earlier_audio_in_the_prompt(earlier: int) -> None:
    out, stream, sent, prefilled = streamed(history(earlier), speech()[:9 * 16000])  # one window + a tail
    assert_same(out, whole(history(earlier), speech()[:9 * 16000]))
    prefix = len(stream.prefix.input_ids)
    assert prefilled == prefix + 104 and sent[-1].keep == prefix + 104 and not sent[-1].restart


def test_turn_longer_than_an_earlier_audio_is_rebased_where_it_pauses() -> None:
    """An earlier audio that ends mid-speech, off the hop: padded in the whole prompt (this turn is longer),
    not at open, so its features and frame count differ from the prefix's. `prepare` starts the request over,
    still open, from the whole prompt; close computes one row; the answer is the whole clip's. Shorter than
    the earlier audio, the turn's prefix is exact from the open on (no restart)."""
    audio = speech()[:9 * 16000]
    for earlier, rebased in ((speech()[16000:56077], True), (speech()[:12 * 16000 + 77], False)):
        messages = [*HISTORY, {"role": "user", "content": [{"type": "audio", "audio": earlier}, "Hi."]},
                    {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "And this?"}]
        out, stream, sent, prefilled = streamed(messages, np.concatenate([audio, np.zeros(4000, np.float32)]),
                                                close_with=audio, paused=(len(audio),))
        assert_same(out, whole(messages, audio))
        assert stream.closed_prepared and prefilled == len(stream.req.prompt.input_ids)
        assert [p.restart for p in sent] == [False] * (len(sent) - 2) + [rebased, False]
        assert not sent[-2].closed and sent[-1].closed


def test_streamed_turn_shares_the_prefix_cache() -> None:
    """An open request takes its history from the prefix cache (its prefix is fixed at open) and, once
    closed, leaves its whole prompt there for the next turn, as an ordinary request does."""
    blocks, audio, bs = omni().engine.thinker.blocks, speech()[:9 * 16000], 16
    first = [{"role": "system", "content": "You share prefixes. " * 6}, {"role": "user", "content": "Hi there."}]
    n_first = omni().chat(first, sampling=SAMPLING, talker_sampling=TALKER).usage.prompt_tokens
    later = [*first, {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "And this?"}]
    hits = blocks.hits
    out, _, _, _ = streamed(later, audio)
    assert blocks.hits - hits == bs * (n_first // bs)
    hits = blocks.hits
    want = whole(later, audio)
    assert_same(out, want)
    assert blocks.hits - hits == bs * ((want.usage.prompt_tokens - 1) // bs)


def test_turn_shorter_than_a_conv_chunk_restarts() -> None:
    # alone its chunk would be padded less than in the whole prompt's call: the request starts over
    out, _, sent, _ = streamed(history(40000), speech()[:8000])
    assert_same(out, whole(history(40000), speech()[:8000]))
    assert [p.restart for p in sent] == [True]


def test_close_with_the_exact_clip() -> None:
    """What was appended differs from the clip the conversation holds in its last samples (as a streaming
    resampler's would): close with the clip itself gives the clip's answer."""
    audio = speech()[:9 * 16000]
    appended = audio.copy()
    appended[-20:] = 0
    out, stream, sent, _ = streamed(user(), appended, close_with=audio)
    assert_same(out, whole(user(), audio))
    assert sent[-1].keep == len(stream.prefix.input_ids) + 104


def test_beside_another_request() -> None:
    """An ordinary request decoding while the open one prefills its windows: both answers as alone (audio
    within 1e-5: code2wav may decode the two in one batch)."""
    o, audio = omni().engine, speech()[:9 * 16000]
    other_messages = user("Count: one, two, three.")
    alone = omni().chat(other_messages, sampling={"temperature": 0, "max_tokens": 12}, talker_sampling=TALKER)
    other = ChatResult()
    req = o.make_request("other", other_messages, None, want_audio=True, voice="Ethan", emit=other.add,
                         sampling={"temperature": 0, "max_tokens": 12}, talker_sampling=TALKER)
    o.add_request(req)
    out, _, _, _ = streamed(user(), audio)
    o.wait(["other"])
    assert_same(out, whole(user(), audio), atol=1e-5)
    assert other.token_ids == alone.token_ids and np.array_equal(other.codes, alone.codes)
    assert np.allclose(other.audio, alone.audio, rtol=0, atol=1e-5)


def test_abort_of_an_open_request_frees_its_kv_blocks() -> None:
    o = omni().engine
    stream = o.open_request("abandoned", user(), want_audio=True, voice="Ethan", sampling=SAMPLING,
                            talker_sampling=TALKER, emit=lambda d: None)
    stream.append_audio(speech()[:9 * 16000])
    wait_prefilled(stream)
    assert o.thinker.blocks.stats()["kv_blocks_used"] > 0
    assert o.abort("abandoned")
    deadline = time.monotonic() + 10
    while o.thinker.num_active and time.monotonic() < deadline:
        time.sleep(0.01)
    assert o.thinker.num_active == 0 and o.thinker.blocks.stats()["kv_blocks_used"] == 0


def test_open_request_needs_a_user_message_last() -> None:
    with pytest.raises(ValueError, match="needs a user message last"):
        omni().engine.open_request("x", [{"role": "system", "content": "s"}], want_audio=False, voice=None,
                                   sampling=SAMPLING, talker_sampling=None, emit=lambda d: None)


def test_async_streaming_prompt_equals_generate() -> None:
    from omnistage.entrypoints.async_omni import AsyncOmni
    from omnistage.sampling_params import SamplingParams, TalkerSamplingParams

    d = tiny_checkpoint("tiny")
    engine = AsyncOmni(d, deploy=load_deploy_config(default_deploy_config(d), platform="cpu"), device="cpu")
    sp, tp, audio = SamplingParams(**SAMPLING), TalkerSamplingParams(**TALKER), speech()[:9 * 16000]

    async def collect(deltas) -> ChatResult:
        out = ChatResult()
        async for delta in deltas:
            out.add(delta)
        return out

    async def main() -> tuple[ChatResult, ChatResult, int]:
        stream = await engine.open_request("a", user(), sp, tp, "Ethan")
        for at in range(0, len(audio), 4800):
            await stream.append_audio(audio[at:at + 4800])
        got = await collect(stream.close())
        content = [{"type": "text", "text": "Answer me."}, {"type": "audio", "audio": audio}]
        messages = [*HISTORY, {"role": "user", "content": content}]
        want = await collect(engine.generate("b", messages, sp, tp, "Ethan"))
        left = await engine.open_request("c", user(), sp, tp, "Ethan")  # abandoned: aborted before close
        await left.append_audio(audio)
        await left.abort()
        return got, want, engine.admission.requests

    try:
        got, want, waiting = asyncio.run(main())
        assert_same(got, want)
        assert waiting == 0 and engine.admission.tokens == 0
        deadline = time.monotonic() + 10
        while engine.engine.thinker.num_active and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.engine.thinker.blocks.stats()["kv_blocks_used"] == 0
    finally:
        engine.shutdown()


def test_a_prompt_renewed_while_admitted_is_admitted_as_encoded(monkeypatch: pytest.MonkeyPatch) -> None:
    # a far thinker's copy of a growing request gets its prompt renewed on the host's thread (a restarting
    # piece's spec) while the worker admits it: the seq is the prompt that was encoded, not the one put there
    import omnistage.pipeline.thinker.admission as admission

    o, thinker = omni().engine, omni().engine.thinker
    make = lambda audio: o.make_request("renewed", [*HISTORY, {"role": "user", "content": [  # noqa: E731
        {"type": "audio", "audio": audio}, "Hi."]}], None, want_audio=False, voice="Ethan", sampling=SAMPLING,
        talker_sampling=TALKER, emit=lambda d: None)
    req, renewed = make(speech()[:40000]), make(speech()[:9 * 16000]).prompt
    encode = admission.encode_media

    def renew_meanwhile(*args, **kwargs):
        media = encode(*args, **kwargs)
        req.prompt = renewed
        return media

    monkeypatch.setattr(admission, "encode_media", renew_meanwhile)
    prefix = req.prompt
    seq = thinker._admit(req)  # NOTE: read after encoding it was "117 placeholder tokens but 33 encoder rows"
    assert seq.prompt_ids.tolist() == prefix.input_ids and len(renewed.input_ids) > len(prefix.input_ids)
