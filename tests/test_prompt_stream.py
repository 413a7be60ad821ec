"""Streaming input (`Orchestrator.open_request`): a spoken turn sent in uneven pieces while it is "spoken"
gives the same text tokens, codec codes and audio samples as the whole clip sent at once (greedy, fp32,
CPU, tiny checkpoint), and the thinker really prefilled its complete encoder windows before close (in a
conversation and beside other work: test_prompt_stream_history.py).

tests/data/speech_17s.flac: `espeak-ng -v en-us -s 150 -w speech.wav "The quick brown fox jumps over the lazy
dog. A journey of a thousand miles begins with a single step. She sells sea shells by the sea shore, and the
shells she sells are surely sea shells. How much wood would ..."`, resampled to 16 kHz
(`omnistage.media.resample`), its first 17.5 s as 16-bit FLAC: 1750 mel frames, two encoder windows of the
tiny preset (800 frames, 104 rows) and a tail of 150."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
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


def whole(messages: list[dict], audio: np.ndarray, o: Omni | None = None) -> ChatResult:
    content = [{"type": "text", "text": messages[-1]["content"]}, {"type": "audio", "audio": audio}]
    return (o or omni()).chat([*messages[:-1], {"role": "user", "content": content}], sampling=SAMPLING,
                              talker_sampling=TALKER)


def streamed(messages: list[dict], audio: np.ndarray, close_with: np.ndarray | None = None,
             paused: tuple[int, ...] = (), o: Omni | None = None, before_close: Callable | None = None):
    """Opens, appends `audio` in pieces of 37 ms, 100 ms, 1.3 s (cycling), `prepare`s its first n samples
    once they are appended (n in `paused`: where the user paused), waits until the thinker has prefilled
    what was sent (`before_close(stream)`, default `wait_prefilled`), closes; returns (result, stream, pieces
    sent, rows prefilled before close)."""
    o = (o or omni()).engine
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
    prefilled = (before_close or wait_prefilled)(stream)
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


def test_a_prepare_that_rewound_leaves_its_windows_sent() -> None:
    """A louder end reaches `prepare` before its audio is appended (the realtime pump prepares first): the
    windows sent before change and go again with the prepared prompt; the audio appended after (silence) sends
    nothing, and close with the prepared clip computes one row."""
    audio = speech().copy()
    audio[-4000:] = np.clip(audio[-4000:] * 3.0, -1, 1)
    rest = np.concatenate([audio[-4000:], np.zeros(8000, np.float32)])

    def louder_end_prepared_first(stream) -> int:
        stream.prepare(audio)
        stream.append_audio(rest)
        return wait_prefilled(stream)

    out, stream, sent, prefilled = streamed(user(), audio[:-4000], close_with=audio,
                                            before_close=louder_end_prepared_first)
    assert_same(out, whole(user(), audio))
    assert stream.closed_prepared and len(stream.sent) == 2 and prefilled == len(stream.req.prompt.input_ids)
    prefix = len(stream.prefix.input_ids)
    assert [(p.keep, p.closed) for p in sent[-2:]] == [(prefix, False), (prefilled - 1, True)]


def test_speech_after_a_pause_leaves_the_ordinary_close() -> None:
    """Prepared at a pause, then the user spoke on (one more window, louder: both sent windows change): what
    `prepare` sent is rewound and close sends what differs, exact; prepared at a pause in the first window,
    the tail it sent is dropped by the next window's piece."""
    audio = speech().copy()
    audio[-4000:] = np.clip(audio[-4000:] * 3.0, -1, 1)
    out, stream, sent, _ = streamed(user(), audio, paused=(9 * 16000, 4 * 16000))
    assert_same(out, whole(user(), audio))
    assert not stream.closed_prepared and sent[-1].keep == len(stream.prefix.input_ids) + 208
