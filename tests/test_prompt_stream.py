"""Streaming input (`Orchestrator.open_request`): a spoken turn sent in uneven pieces while it is "spoken"
gives the same text tokens, codec codes and audio samples as the whole clip sent at once (greedy, fp32,
CPU, tiny checkpoint), and the thinker really prefilled its complete encoder windows before close.

tests/data/speech_17s.flac: `espeak-ng -v en-us -s 150 -w speech.wav "The quick brown fox jumps over the lazy
dog. A journey of a thousand miles begins with a single step. She sells sea shells by the sea shore, and the
shells she sells are surely sea shells. How much wood would ..."`, resampled to 16 kHz
(`omnistage.media.resample`), its first 17.5 s as 16-bit FLAC: 1750 mel frames, two encoder windows of the
tiny preset (800 frames, 104 rows) and a tail of 150."""

from __future__ import annotations

import asyncio
import functools
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

from omnistage.config_loader import default_deploy_config, load_deploy_config
from omnistage.entrypoints.omni import ChatResult, Omni
from omnistage.models.qwen3_omni.make_tiny import tiny_checkpoint

CLIP = Path(__file__).parent / "data" / "speech_17s.flac"
SAMPLING = {"temperature": 0, "max_tokens": 5}
TALKER = {"temperature": 0, "max_frames": 6}
HISTORY = [{"role": "system", "content": "You are a helpful voice."}]
PIECES_MS = (37, 100, 1300)


@functools.cache
def omni() -> Omni:
    d = tiny_checkpoint("tiny")
    return Omni(d, deploy=load_deploy_config(default_deploy_config(d), platform="cpu"), device="cpu")


@functools.cache
def speech() -> np.ndarray:
    # NOTE: the clip's loudest frame is late: scaled so that the first window holds it (the usual case to
    # test); `test_louder_end_rewinds_and_stays_exact` keeps a late maximum.
    x = sf.read(CLIP, dtype="float32")[0]
    return np.concatenate([x[:32000], 0.6 * x[32000:]]).astype(np.float32)


def user(text: str = "Answer me.") -> list[dict]:
    return [*HISTORY, {"role": "user", "content": text}]


def whole(messages: list[dict], audio: np.ndarray) -> ChatResult:
    content = [{"type": "text", "text": messages[-1]["content"]}, {"type": "audio", "audio": audio}]
    return omni().chat([*messages[:-1], {"role": "user", "content": content}], sampling=SAMPLING,
                       talker_sampling=TALKER)


def streamed(messages: list[dict], audio: np.ndarray, close_with: np.ndarray | None = None,
             paused: tuple[int, ...] = ()):
    """Opens, appends `audio` in pieces of 37 ms, 100 ms, 1.3 s (cycling), `prepare`s its first n samples
    once they are appended (n in `paused`: where the user paused), waits until the thinker has prefilled
    what was sent, closes; returns (result, stream, pieces sent, rows prefilled before close)."""
    o = omni().engine
    out, sent = ChatResult(), []
    stream = o.open_request("s-" + str(time.monotonic_ns()), messages, want_audio=True, voice="Ethan",
                            sampling=SAMPLING, talker_sampling=TALKER, emit=out.add)
    send = stream.send
    stream.send = lambda piece: (sent.append(piece), send(piece))
    at, i = 0, 0
    while at < len(audio):
        n = 16 * PIECES_MS[i % len(PIECES_MS)]
        stream.append_audio(audio[at:at + n])
        at, i = at + n, i + 1
        for end in paused:
            if at - n < end <= at:
                stream.prepare(audio[:end])
    prefilled = wait_prefilled(stream)
    stream.close(close_with)
    o.wait([stream.req.request_id])
    return out, stream, sent, prefilled


def wait_prefilled(stream, timeout: float = 30.0) -> int:
    """The thinker's prefilled rows of the open request once they reach what was sent."""
    thinker, deadline = omni().engine.thinker, time.monotonic() + timeout
    while time.monotonic() < deadline:
        seq = next((s for s in thinker.running if s.req is stream.req), None)
        if seq is not None and seq.num_computed == stream.early_rows:
            return seq.num_computed
        time.sleep(0.01)
    raise AssertionError("the thinker did not prefill the pieces sent")


def assert_same(a: ChatResult, b: ChatResult, atol: float = 0.0) -> None:
    """`atol`: for audio decoded beside other requests (code2wav's rounding follows its batch)."""
    assert a.token_ids == b.token_ids and len(a.token_ids) == SAMPLING["max_tokens"]
    assert np.array_equal(a.codes, b.codes) and a.codes.shape[1] >= 2
    assert a.audio.shape == b.audio.shape and np.allclose(a.audio, b.audio, rtol=0, atol=atol)
    assert a.usage.prompt_tokens == b.usage.prompt_tokens


def test_streamed_speech_equals_whole_clip() -> None:
    audio, thinker = speech(), omni().engine.thinker
    prompts, to_talker = [], thinker.to_talker
    def spy(chunk) -> None:
        if chunk.prompt is not None:
            prompts.append(chunk.prompt)
        to_talker(chunk)

    thinker.to_talker = spy
    try:
        out, stream, sent, prefilled = streamed(user(), audio)
        assert_same(out, whole(user(), audio))
    finally:
        thinker.to_talker = to_talker
    # the prompt rows (encoder rows scattered in) are bit-equal; NOTE: the thinker's hidden rows are not quite
    # (|diff| ~2e-6: CPU GEMM and SDPA results depend on the row count, as between any two prefill chunkings)
    streamed_prompt, whole_prompt = prompts
    assert torch.equal(streamed_prompt.prompt_ids, whole_prompt.prompt_ids)
    assert torch.equal(streamed_prompt.embeds, whole_prompt.embeds)
    prefix = len(stream.prefix.input_ids)
    assert prefilled == prefix + 2 * 104  # both complete windows were encoded and prefilled before close
    windows, last = sent[:-1], sent[-1]
    assert [(p.keep, len(p.input_ids), p.audio.shape[1]) for p in windows] == [(prefix, 104, 800),
                                                                                (prefix + 104, 104, 800)]
    # close: only the tail (150 frames -> 20 rows) and the template's end
    assert last.closed and not last.restart and last.keep == prefix + 208 and last.audio.shape[1] == 150
    end = omni().engine.processor.tokenizer("<|audio_end|><|im_end|>\n<|im_start|>assistant\n")["input_ids"]
    assert len(last.input_ids) == 20 + len(end)


def test_tail_without_a_whole_chunk_is_encoded_after_its_window() -> None:
    audio = speech()[:1650 * 160 + 100]  # tail of 50 frames: alone it would be padded to 50, not 100
    out, _, sent, _ = streamed(user(), audio)
    assert_same(out, whole(user(), audio))
    assert sent[-1].audio.shape[1] == 850 and sent[-1].skip == 104


def test_louder_end_rewinds_and_stays_exact() -> None:
    audio = speech().copy()
    audio[-4000:] = np.clip(audio[-4000:] * 3.0, -1, 1)  # the global maximum moves: every floor-clamped value
    out, stream, sent, _ = streamed(user(), audio)
    assert_same(out, whole(user(), audio))
    prefix = len(stream.prefix.input_ids)
    # both windows sent again as the louder audio came, while "speaking"; close sends only the tail
    assert any(p.keep == prefix and len(p.input_ids) == 208 and not p.closed for p in sent[2:])
    assert sent[-1].keep == prefix + 208 and sent[-1].audio.shape[1] == 150


def test_rising_maximum_while_speaking_rewinds_early() -> None:
    audio = speech().copy()
    audio[140000:200000] *= 2.5  # a louder second window: the first, sent before it, is sent again with it
    out, stream, sent, _ = streamed(user(), audio)
    assert_same(out, whole(user(), audio))
    prefix = len(stream.prefix.input_ids)
    shape = [(p.keep, len(p.input_ids), p.closed) for p in sent]
    assert shape[0] == (prefix, 104, False) and shape[-2:] == [(prefix + 104, 104, False), (prefix + 208, 26, True)]
    assert set(shape[1:-2]) == {(prefix, 104, False)}  # the first window again as the louder audio came


def test_turn_prepared_where_it_ends_closes_with_one_row() -> None:
    """`prepare` at the turn's end (then silence the clip does not hold): the thinker has the whole prompt
    before close, which computes only its last row again; the answer is the whole clip's."""
    audio = speech()
    out, stream, sent, prefilled = streamed(user(), np.concatenate([audio, np.zeros(8000, np.float32)]),
                                            close_with=audio, paused=(len(audio),))
    assert_same(out, whole(user(), audio))
    n = len(stream.req.prompt.input_ids)
    assert prefilled == n and stream.closed_prepared
    tail, last = sent[-2], sent[-1]
    assert not tail.closed and tail.keep == len(stream.prefix.input_ids) + 208 and tail.audio.shape[1] == 150
    assert (last.keep, last.input_ids, last.audio, last.closed) == (n - 1, stream.req.prompt.input_ids[-1:],
                                                                    None, True)


def test_speech_after_a_pause_leaves_the_ordinary_close() -> None:
    """Prepared at a pause, then the user spoke on (one more window, louder: both sent windows change): what
    `prepare` sent is rewound and close sends what differs, exact; prepared at a pause in the first window,
    the tail it sent is dropped by the next window's piece."""
    audio = speech().copy()
    audio[-4000:] = np.clip(audio[-4000:] * 3.0, -1, 1)
    out, stream, sent, _ = streamed(user(), audio, paused=(9 * 16000, 4 * 16000))
    assert_same(out, whole(user(), audio))
    assert not stream.closed_prepared and sent[-1].keep == len(stream.prefix.input_ids) + 208


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
