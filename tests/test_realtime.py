"""/v1/realtime through the official openai SDK's realtime client, on a real `omnistage serve` (tiny
checkpoint, --api-key, --max-audio-seconds 20): event sequences, server VAD turns (an espeak-ng clip),
manual commits, history equal to chat completions (same tokens and codes: same transcript and audio bytes),
a long spoken turn prefilled while spoken (streaming input) equal to chat, its request freed on every path
that leaves it, barge-in and response.cancel (aborted in every stage, the answer truncated), bad events,
ignore_eos, 32 sessions."""

from __future__ import annotations

import asyncio
import base64
import io
import re
import math
import time
from importlib.resources import files
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import soundfile as sf

from omnistage.media import resample
from serve_process import KEY, MODEL, Server, samples

TURN = {"max_output_tokens": 4, "max_audio_frames": 4, "seed": 7}
MANUAL = {"type": "realtime", "audio": {"input": {"turn_detection": None}}, **TURN}


@pytest.fixture(scope="module")
def rt_server(tmp_path_factory, tiny_dir):
    log = tmp_path_factory.mktemp("realtime") / "rt.log"
    server = Server(log, "--api-key", KEY, "--max-audio-seconds", "20",
                    "--deploy-overrides", '{"realtime_streaming_input": true}')
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


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


def test_text_item_events(rt_server):
    async def main():
        async with client(rt_server).realtime.connect(model=MODEL) as conn:
            first = await conn.recv()
            assert first.type == "session.created" and first.session.model == MODEL
            assert first.session.audio.input.turn_detection.type == "server_vad"
            audio = {**MANUAL["audio"], "output": {"voice": "ETHAN"}}
            await conn.session.update(session={**MANUAL, "audio": audio})
            updated = await conn.recv()
            assert updated.type == "session.updated" and updated.session.audio.output.voice == "ethan"
            await conn.conversation.item.create(item=text_item("Hello there."))
            added, done = await conn.recv(), await conn.recv()
            assert (added.type, done.type) == ("conversation.item.added", "conversation.item.done")
            await conn.response.create()
            events = await until(conn, "response.done")
            assert shape(events) == AUDIO_EVENTS
            text, audio, response = answer(events)
            assert response.status == "incomplete" and response.status_details.reason == "max_output_tokens"
            assert len(audio) == 2 * samples(4)
            assert response.usage.output_tokens == 8 and response.usage.output_token_details.audio_tokens == 4
            assert response.output[0].content[0].transcript == text
            assert response.output[0].status == "incomplete"
            done = next(e for e in events if e.type == "response.output_audio_transcript.done")
            assert done.transcript == text and done.item_id == response.output[0].id

            await conn.response.create(response={"output_modalities": ["text"], "conversation": "none",
                                                 "max_output_tokens": 3})
            events = await until(conn, "response.done")
            assert shape(events) == ["response.created", "response.output_item.added",
                                     "response.content_part.added", "response.output_text.done",
                                     "response.content_part.done", "response.output_item.done",
                                     "response.done"]
            deltas = [e for e in events if e.type == "response.output_text.delta"]
            assert len(deltas) == 3 and events[-1].response.usage.output_tokens == 3
            assert not any(e.type == "response.output_audio.delta" for e in events)

    asyncio.run(main())


def test_manual_commit_history_equals_chat(rt_server):
    """Two turns (spoken, then typed) through the session, and the same conversation through chat
    completions: the same transcripts, audio bytes and usage; `audio: {id}` stands for the answer."""
    pcm = speech_pcm()

    async def main():
        async with client(rt_server).realtime.connect(model=MODEL) as conn:
            await setup(conn, {**MANUAL, "instructions": "Be brief."})
            await append(conn, pcm)
            await conn.input_audio_buffer.commit()
            committed = await conn.recv()
            assert committed.type == "input_audio_buffer.committed"
            assert [(await conn.recv()).type for _ in range(2)] == ["conversation.item.added",
                                                                     "conversation.item.done"]
            await conn.response.create()
            first = answer(await until(conn, "response.done"))
            await say(conn, "And then?")
            await conn.response.create()
            second = answer(await until(conn, "response.done"))
            return first, second

    first, second = asyncio.run(main())
    wav = io.BytesIO()
    sf.write(wav, np.frombuffer(pcm, "<i2"), 24000, format="WAV", subtype="PCM_16")
    user = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "input_audio",
                                          "input_audio": {"data": b64(wav.getvalue()), "format": "wav"}}]}]
    for (text, audio, response), history in (
            (first, user),
            (second, [*user, {"role": "assistant", "content": first[0]},
                      {"role": "user", "content": "And then?"}]),
            (second, [*user, {"role": "assistant", "audio": {"id": first[2].output[0].id}},
                      {"role": "user", "content": "And then?"}])):
        reply = chat(rt_server, history)
        assert chat_audio(reply) == (text, audio) and len(audio) == 2 * samples(4)
        assert reply["usage"]["prompt_tokens"] == response.usage.input_tokens
        assert reply["usage"]["completion_tokens"] == response.usage.output_tokens == 8
    unknown = httpx.post(rt_server.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                         json={"model": MODEL,
                               "messages": [{"role": "assistant", "audio": {"id": "audio_x"}}]})
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "messages[0].audio.id"


def test_spoken_turn_with_server_vad(rt_server):
    async def main():
        async with client(rt_server).realtime.connect(model=MODEL) as conn:
            await setup(conn, {"type": "realtime", **TURN, "audio": {"input": {"turn_detection": {
                "type": "server_vad", "silence_duration_ms": 300}}}})
            await append(conn, silence(500) + speech_pcm() + silence(800))
            events = await until(conn, "response.done")
            kinds = shape(events)
            assert kinds[:5] == ["input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
                                 "input_audio_buffer.committed", "conversation.item.added",
                                 "conversation.item.done"] and kinds[5:] == AUDIO_EVENTS
            started, stopped, committed = events[:3]
            assert started.item_id == stopped.item_id == committed.item_id
            assert 0 < started.audio_start_ms < 500 < stopped.audio_end_ms < 500 + 2613 + 300
            assert len(answer(events)[1]) == 2 * samples(4)
            await conn.conversation.item.retrieve(item_id=committed.item_id)
            user = (await conn.recv()).item
            assert user.role == "user" and user.content[0].type == "input_audio"

    asyncio.run(main())


def pieces(pcm: bytes) -> list[bytes]:
    """`pcm` cut into 20, 30, 40, 20, ... ms pieces."""
    out, at = [], 0
    while at < len(pcm):
        n = (960, 1440, 1920)[len(out) % 3]
        out.append(pcm[at:at + n])
        at += n
    return out


def wav_messages(pcm: bytes, system: str | None = None) -> list[dict]:
    wav = io.BytesIO()
    sf.write(wav, np.frombuffer(pcm, "<i2"), 24000, format="WAV", subtype="PCM_16")
    audio = {"type": "input_audio", "input_audio": {"data": b64(wav.getvalue()), "format": "wav"}}
    system_message = [{"role": "system", "content": system}] if system else []
    return [*system_message, {"role": "user", "content": [audio]}]


LONG_TURN = {"type": "realtime", **TURN, "audio": {"input": {"turn_detection": {
    "type": "server_vad", "silence_duration_ms": 1000}}}}


def test_long_spoken_turn_prefilled_while_spoken_equals_chat(rt_server):
    """A 17.5 s turn sent in 20-40 ms appends: its request is opened at speech start and its two complete
    encoder windows (104 rows each) are prefilled before the turn ends (and kept); the answer is that of the
    committed clip through chat completions (same transcript, audio bytes and usage)."""
    pcm = silence(400) + long_speech_pcm()
    rows = "omnistage_realtime_streamed_prompt_rows_total"
    before = counter(rt_server, rows)

    async def main():
        async with client(rt_server).realtime.connect(model=MODEL) as conn:
            await setup(conn, {**LONG_TURN, "instructions": "Be brief."})
            for piece in pieces(pcm):
                await conn.input_audio_buffer.append(audio=b64(piece))
            wait_held(rt_server, (2 * 104 + 12) // 16 + 1)  # KV of the prefix and both windows (16 a block)
            await append(conn, silence(1500), 960)
            return await until(conn, "response.done")

    events = asyncio.run(main())
    started, stopped = events[0], events[1]
    assert (started.type, stopped.type) == ("input_audio_buffer.speech_started",
                                            "input_audio_buffer.speech_stopped")
    clip = (pcm + silence(1500))[started.audio_start_ms * 48:stopped.audio_end_ms * 48]
    assert len(clip) // 2 * 2 // 3 // 160 >= 1600  # two complete windows of 800 mel frames
    assert counter(rt_server, rows) - before == 2 * 104
    text, audio, response = answer(events)
    reply = chat(rt_server, wav_messages(clip, "Be brief."))
    assert chat_audio(reply) == (text, audio) and len(audio) == 2 * samples(4)
    assert reply["usage"]["prompt_tokens"] == response.usage.input_tokens
    assert_nothing_held(rt_server)


def test_streamed_16k_audio_is_the_committed_clips():
    """What a spoken turn's open request is fed while it is spoken (20-40 ms appends through the
    StreamResampler) is bit for bit the committed clip's pcm_to_16k, up to the last ~10 samples (which wait
    for input their filter reaches; close passes the whole clip)."""
    from omnistage.server.realtime.conversation import pcm_float, pcm_to_16k
    from omnistage.server.realtime.resample import StreamResampler

    pcm, r = long_speech_pcm(), StreamResampler()
    fed = np.concatenate([r.push(pcm_float(piece)) for piece in pieces(pcm)])
    whole = pcm_to_16k(pcm)
    assert whole.size - 10 <= fed.size < whole.size and np.array_equal(fed, whole[:fed.size])


def test_open_turn_request_is_freed_on_every_path(rt_server):
    """The request opened at speech start is aborted by a clear, a manual commit, a response.cancel, a
    session.update, and the socket closing, mid-speech; none is opened when server VAD will not answer
    (create_response false)."""
    speech = silence(300) + speech_pcm()[:48000]

    async def speaking(conn) -> None:
        await append(conn, speech, 1920)
        await until(conn, "input_audio_buffer.speech_started")
        wait_held(rt_server)

    async def main():
        async with client(rt_server).realtime.connect(model=MODEL) as conn:
            await setup(conn, LONG_TURN)
            await speaking(conn)
            await conn.input_audio_buffer.clear()
            await until(conn, "input_audio_buffer.cleared")
            assert_nothing_held(rt_server)
            await speaking(conn)
            await conn.input_audio_buffer.commit()
            await until(conn, "conversation.item.done")
            assert_nothing_held(rt_server)
            await speaking(conn)
            await conn.response.cancel()  # nothing plays, but the turn's prompt would hold the answer cut
            assert (await conn.recv()).error.code == "response_cancel_not_active"
            assert_nothing_held(rt_server)
            await conn.input_audio_buffer.clear()
            await until(conn, "input_audio_buffer.cleared")
            await speaking(conn)
            await conn.session.update(session={"instructions": "Shorter."})
            await until(conn, "session.updated")
            assert_nothing_held(rt_server)
            await conn.input_audio_buffer.clear()
            await until(conn, "input_audio_buffer.cleared")
            vad = LONG_TURN["audio"]["input"]["turn_detection"]
            await conn.session.update(session={"audio": {"input": {"turn_detection": {
                **vad, "create_response": False}}}})
            await until(conn, "session.updated")
            await append(conn, speech, 1920)
            await until(conn, "input_audio_buffer.speech_started")
            await append(conn, silence(200))
            assert_nothing_held(rt_server)
        async with client(rt_server).realtime.connect(model=MODEL) as conn:
            await setup(conn, LONG_TURN)
            await speaking(conn)
        assert_nothing_held(rt_server)

    asyncio.run(main())


def test_ignore_eos_answers_are_exactly_the_caps(rt_server):
    async def main():
        async with client(rt_server).realtime.connect(model=MODEL) as conn:
            await setup(conn, {**MANUAL, "ignore_eos": True, "max_output_tokens": 6, "max_audio_frames": 6})
            await say(conn, "Hello.")
            await conn.response.create()
            first = answer(await until(conn, "response.done"))
            await conn.send({"type": "session.update", "session": {"ignore_eos": "yes"}})
            error = await conn.recv()
            return first, error

    (_, audio, response), error = asyncio.run(main())
    assert len(audio) == 2 * samples(6) and response.usage.output_token_details.audio_tokens == 6
    assert response.usage.output_token_details.text_tokens == 6 and response.status == "incomplete"
    assert (error.type, error.error.param) == ("error", "session.ignore_eos")


def test_ignore_eos_reaches_the_thinker_and_the_talker():
    from omnistage.config import DEPLOY_DIR, load_deploy_config
    from omnistage.server.realtime.events import ResponseParams
    from omnistage.server.realtime.settings import Resolved, initial, updated

    deploy = load_deploy_config(DEPLOY_DIR / "qwen3_omni_moe.yaml", platform="cpu")
    session = updated(initial(["Ethan"], MODEL), {"ignore_eos": True}, ["Ethan"], MODEL)
    sampling, talker = Resolved(session, ResponseParams(), ["Ethan"]).sampling(deploy)
    assert sampling.ignore_eos and talker.ignore_eos
    sampling, talker = Resolved(session, ResponseParams(ignore_eos=False), ["Ethan"]).sampling(deploy)
    assert not sampling.ignore_eos and not talker.ignore_eos


def test_barge_in_cancels_and_truncates(rt_server):
    """Speech while an answer plays cancels it (turn_detected): aborted in every stage, the item cut to the
    audio sent and the transcript of as many tokens as frames; then the spoken turn gets its answer."""
    long = {"max_output_tokens": 400, "max_audio_frames": 400}

    async def main():
        async with client(rt_server).realtime.connect(model=MODEL) as conn:
            await setup(conn, {"type": "realtime", **TURN, "audio": {"input": {"turn_detection": {
                "type": "server_vad", "silence_duration_ms": 300}}}})
            await say(conn, "Talk a lot.")
            await conn.response.create(response=long)
            events = await until(conn, "response.output_audio.delta")
            await append(conn, speech_pcm() + silence(800))
            events += await until(conn, "response.done")
            text, audio, response = answer(events)
            assert response.status == "cancelled" and response.status_details.reason == "turn_detected"
            assert "input_audio_buffer.speech_started" in shape(events)
            item, deltas = response.output[0], transcript_deltas(events)
            frames = math.ceil(len(audio) / 2 / 1920)  # the talker speaks token t in frame t
            assert item.status == "incomplete" and 0 < frames < len(deltas)
            assert item.content[0].transcript == "".join(deltas[:frames])
            assert_nothing_held(rt_server)
            after = await until(conn, "response.done")
            assert after[-1].response.status == "incomplete"
            await conn.conversation.item.retrieve(item_id=item.id)
            assert (await conn.recv()).item.content[0].transcript == item.content[0].transcript

            await conn.session.update(session=MANUAL)
            await until(conn, "session.updated")
            await conn.response.create(response=long)
            events = await until(conn, "response.output_audio.delta")
            await conn.response.cancel()
            events += await until(conn, "response.done")
            text, audio, response = answer(events)
            assert response.status == "cancelled" and response.status_details.reason == "client_cancelled"
            assert_nothing_held(rt_server)
            item = response.output[0].id
            await conn.conversation.item.truncate(item_id=item, content_index=0, audio_end_ms=10)
            truncated = await conn.recv()
            assert (truncated.type, truncated.audio_end_ms) == ("conversation.item.truncated", 10)
            await conn.conversation.item.retrieve(item_id=item)
            kept = (await conn.recv()).item.content[0].transcript
            assert kept == transcript_deltas(events)[0]  # 10 ms: within the first frame, so the first token
            await conn.response.cancel()
            error = await conn.recv()
            assert error.type == "error" and error.error.code == "response_cancel_not_active"

    asyncio.run(main())


def test_bad_events_keep_the_session(rt_server):
    async def main():
        async with client(rt_server).realtime.connect(model=MODEL) as conn:
            await setup(conn, MANUAL)
            bad = [({"type": "no.such.event", "event_id": "e1"}, "type", "invalid_value"),
                   ({"type": "input_audio_buffer.append", "audio": "%%%", "event_id": "e2"}, "audio",
                    "invalid_base64"),
                   ({"type": "session.update", "session": {"audio": {"input": {"format": {
                       "type": "audio/pcm", "rate": 16000}}}}, "event_id": "e3"},
                    "session.audio.input.format.rate", "invalid_value"),
                   ({"type": "session.update", "session": {"audio": {"output": {"voice": "alloy"}}},
                     "event_id": "e4"}, "session.audio.output.voice", "invalid_value"),
                   ({"type": "input_audio_buffer.append", "audio": b64(silence(21000)), "event_id": "e5"},
                    "audio", "input_audio_buffer_full"),
                   ({"type": "input_audio_buffer.commit", "event_id": "e6"}, None,
                    "input_audio_buffer_commit_empty"),
                   ({"type": "response.create", "event_id": "e7"}, None, "conversation_empty")]
            for event, param, code in bad:
                await conn.send(event)
                error = await conn.recv()
                assert error.type == "error" and error.event_id.startswith("event_")
                got = (error.error.event_id, error.error.param, error.error.code)
                assert got == (event["event_id"], param, code), error
            await conn.input_audio_buffer.append(audio=b64(silence(300)))
            await conn.input_audio_buffer.clear()
            assert (await conn.recv()).type == "input_audio_buffer.cleared"
            await conn.input_audio_buffer.commit()  # cleared: nothing to commit
            assert (await conn.recv()).error.code == "input_audio_buffer_commit_empty"
            await conn.conversation.item.create(item={**text_item("Gone soon."), "id": "item_gone"})
            await until(conn, "conversation.item.done")
            await conn.conversation.item.delete(item_id="item_gone")
            assert (await conn.recv()).type == "conversation.item.deleted"
            await conn.conversation.item.retrieve(item_id="item_gone")
            assert (await conn.recv()).error.code == "item_not_found"
            await conn.send({"type": "input_audio_buffer.append", "audio": b64(silence(5000))})
            await conn.input_audio_buffer.commit()
            assert (await conn.recv()).type == "input_audio_buffer.committed"
            await conn.response.create()
            events = await until(conn, "response.done")
            assert len(answer(events)[1]) == 2 * samples(4)

    asyncio.run(main())


def test_wrong_api_key_or_model_is_refused(rt_server):
    async def main():
        with pytest.raises(Exception) as info:
            async with client(rt_server, "sk-wrong").realtime.connect(model=MODEL) as conn:
                await conn.recv()
        assert "401" in str(info.value)
        async with client(rt_server).realtime.connect(model="gpt-realtime") as conn:
            error = await conn.recv()
            assert (error.type, error.error.code, error.error.param) == ("error", "model_not_found", "model")

    asyncio.run(main())


def test_32_sessions_one_dropped(rt_server):
    async def one(i: int) -> list[str] | None:
        async with client(rt_server).realtime.connect(model=MODEL) as conn:
            await setup(conn, MANUAL)
            await say(conn, f"Count {i}.")
            longer = {"max_output_tokens": 40, "max_audio_frames": 40}
            await conn.response.create(response=longer if i == 0 else None)
            if i == 0:
                await until(conn, "response.output_audio.delta")
                return None  # closes mid-response
            events = await until(conn, "response.done", 240)
            assert len(answer(events)[1]) == 2 * samples(4)
            return shape(events)

    async def main():
        return await asyncio.gather(*(one(i) for i in range(32)))

    shapes = asyncio.run(main())
    assert shapes[0] is None and all(s == AUDIO_EVENTS for s in shapes[1:])
    assert_nothing_held(rt_server)


def test_transcript_store_is_bounded_and_expires():
    from omnistage.server.realtime.transcripts import TranscriptStore

    now = [1000.0]
    store = TranscriptStore(capacity=2, clock=lambda: now[0])
    store.put("a", "one", expires_at=1010)
    store.put("b", "two")
    assert store.get("a") == "one"  # now the most recently used
    store.put("c", "three")
    assert (store.get("b"), store.get("a"), store.get("c"), len(store)) == (None, "one", "three", 2)
    now[0] = 1010
    assert store.get("a") is None and store.get("c") == "three" and len(store) == 1
