"""Shared by the realtime tests (tests/test_realtime*.py), loaded as a plugin (`pytest_plugins`) so pytest
rewrites its asserts: one real `omnistage serve` for the session (tiny checkpoint, --api-key,
--max-audio-seconds 20, streaming input on), speech clips as 24 kHz pcm16, the SDK client and event helpers,
and the server's /metrics read back."""

from __future__ import annotations

import asyncio
import base64
import io
import re
import time
from collections.abc import Iterator
from importlib.resources import files
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import soundfile as sf

from omnistage.media import resample
from serve_process import KEY, MODEL, Server

TURN = {"max_output_tokens": 4, "max_audio_frames": 4, "seed": 7}
MANUAL = {"type": "realtime", "audio": {"input": {"turn_detection": None}}, **TURN}
VAD = {"type": "realtime", **TURN, "audio": {"input": {"turn_detection": {"type": "server_vad",
                                                                         "silence_duration_ms": 300}}}}


def realtime_server(tmp_path_factory, *args: str, overrides: str = "") -> Iterator[Server]:
    """`overrides`: more deploy keys (JSON object members)."""
    log = tmp_path_factory.mktemp("realtime") / "rt.log"
    deploy = ", ".join(['"realtime_streaming_input": true', *([overrides] if overrides else [])])
    server = Server(log, "--api-key", KEY, "--max-audio-seconds", "20", "--deploy-overrides", "{%s}" % deploy, *args)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def rt_server(tmp_path_factory, tiny_dir):
    yield from realtime_server(tmp_path_factory)


@pytest.fixture(scope="session")
def rt_pipeline_server(tmp_path_factory, tiny_dir):
    """The stages in a worker process of their own (`placement: pipeline`, one pipeline)."""
    yield from realtime_server(tmp_path_factory, "--placement", "pipeline")


@pytest.fixture(scope="session")
def rt_unpreempted_server(tmp_path_factory, tiny_dir):
    """`realtime_preemptive_response` off: a turn's response starts when server VAD ends the turn."""
    yield from realtime_server(tmp_path_factory, overrides='"realtime_preemptive_response": false')


def to_pcm(wav: np.ndarray, rate: int) -> bytes:
    return (np.clip(resample(wav, rate, 24000), -1, 1) * 32767).astype("<i2").tobytes()


def speech_pcm() -> bytes:
    """The espeak-ng question (16 kHz wav) as 24 kHz s16le."""
    wav, rate = sf.read(io.BytesIO(files("omnistage.data").joinpath("speech/question_2s.wav").read_bytes()),
                        dtype="float32")
    return to_pcm(wav, rate)


def long_speech_pcm() -> bytes:
    """tests/data/speech_17s.flac (see test_prompt_stream.py), its loudest frame in the first 2 s (so the
    first encoder window's log-mel floor is final when it is sent), as 24 kHz s16le."""
    wav, rate = sf.read(Path(__file__).parent / "data" / "speech_17s.flac", dtype="float32")
    return to_pcm(np.concatenate([wav[:2 * rate], 0.6 * wav[2 * rate:]]), rate)


def silence(ms: int) -> bytes:
    return bytes(ms * 48)


def spoken_turn() -> bytes:
    """Half a second of silence, the espeak-ng question, then silence enough for `VAD` to end the turn."""
    return silence(500) + speech_pcm() + silence(800)


def b64(pcm: bytes) -> str:
    return base64.b64encode(pcm).decode()


def client(server, key: str = KEY) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


async def until(conn, last: str, limit: float = 60) -> list:
    out = []
    async with asyncio.timeout(limit):
        while not out or out[-1].type != last:
            out.append(await conn.recv())
    return out


async def scored(conn) -> list:
    """The events sent until server VAD scored all the audio appended so far (their turns handled): the server
    handles any other event after that (`RealtimeSession.handle`); a retrieve of no item is one, its error left
    out. The test's appends run ahead of real time, the VAD behind them."""
    await conn.conversation.item.retrieve(item_id="item_none")
    events = await until(conn, "error")
    assert events[-1].error.code == "item_not_found"
    return events[:-1]


async def setup(conn, session: dict) -> None:
    assert (await conn.recv()).type == "session.created"
    await conn.session.update(session=session)
    assert (await conn.recv()).type == "session.updated"


async def append(conn, pcm: bytes, chunk: int = 9600) -> None:
    for i in range(0, len(pcm), chunk):
        await conn.input_audio_buffer.append(audio=b64(pcm[i:i + chunk]))


def transcript_deltas(events: list) -> list[str]:
    return [e.delta for e in events if e.type == "response.output_audio_transcript.delta"]


def text_item(text: str) -> dict:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


async def say(conn, text: str) -> None:
    await conn.conversation.item.create(item=text_item(text))
    await until(conn, "conversation.item.done")


def answer(events: list) -> tuple[str, bytes, object]:
    """(transcript from the deltas, audio bytes, response.done's response) of one response."""
    text = "".join(transcript_deltas(events))
    audio = b"".join(base64.b64decode(e.delta) for e in events if e.type == "response.output_audio.delta")
    return text, audio, events[-1].response


AUDIO_EVENTS = ["response.created", "response.output_item.added", "conversation.item.added",
                "response.content_part.added", "response.output_audio.done",
                "response.output_audio_transcript.done", "response.content_part.done",
                "response.output_item.done", "conversation.item.done", "response.done"]


def shape(events: list) -> list[str]:
    return [e.type for e in events if not e.type.endswith(".delta")]


def gauges(server, name: str) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics").text
    return {m.group(1): float(m.group(2)) for m in re.finditer(rf'{name}\{{stage="(\w+)"\}} (\S+)', text)}


def assert_nothing_held(server) -> None:
    deadline = time.monotonic() + 10
    held = lambda: [v for n in ("omnistage_stage_requests_active", "omnistage_kv_cache_blocks_in_use")
                    for v in gauges(server, n).values()]
    while any(held()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert held() and not any(held())


def counter(server, name: str) -> float:
    """A label-less counter's value (0 before its first count: not rendered yet)."""
    found = re.search(rf"^{name} (\S+)$", httpx.get(server.url + "/metrics").text, re.M)
    return float(found.group(1)) if found else 0.0


def wait_held(server, blocks: int = 1) -> None:
    """Until the thinker holds `blocks` KV blocks (of a spoken turn's request, opened at speech start)."""
    deadline = time.monotonic() + 10
    while gauges(server, "omnistage_kv_cache_blocks_in_use").get("thinker", 0) < blocks:
        assert time.monotonic() < deadline, "no request was opened at speech start"
        time.sleep(0.02)


def chat(server, messages: list[dict]) -> dict:
    body = {"model": MODEL, "messages": messages, "modalities": ["text", "audio"], "audio": {"format": "wav"},
            "max_tokens": 4, "max_audio_frames": 4, "seed": 7}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                   timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def chat_audio(reply: dict) -> tuple[str, bytes]:
    audio = reply["choices"][0]["message"]["audio"]
    pcm = sf.read(io.BytesIO(base64.b64decode(audio["data"])), dtype="int16")[0]
    return audio["transcript"], pcm.tobytes()
