"""/v1/realtime through the official openai SDK's realtime client, on a real `omnistage serve`
(realtime_helpers.py): event sequences, server VAD turns (an espeak-ng clip), manual commits, history equal to
chat completions (same tokens and codes: same transcript and audio bytes), barge-in and response.cancel
(aborted in every stage, the answer truncated), bad events, the API key, 32 sessions, the transcript store."""

from __future__ import annotations

import asyncio
import io
import math

import httpx
import numpy as np
import pytest
import soundfile as sf
from serve_process import KEY, MODEL, samples
from realtime_helpers import (AUDIO_EVENTS, MANUAL, VAD, answer, append, assert_nothing_held, b64, chat,
                             chat_audio, client, gauges, say, setup, shape, silence, speech_pcm, spoken_turn,
                             text_item, transcript_deltas, until)

pytest_plugins = ["realtime_helpers"]


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

    hits = lambda: [gauges(rt_server, f"omnistage_{k}_cache_hits_total").get("thinker", 0)
                    for k in ("prefix", "encoder")]
    before = hits()
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
    prefix, encoder = (b - a for a, b in zip(before, hits()))
    # every prompt after the first holds the first's prefix and audio; the first's audio may be cached already
    # (an earlier test on this shared server spoke the same clip)
    assert prefix >= 16 * 5 and encoder in (4, 5)
    unknown = httpx.post(rt_server.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                         json={"model": MODEL,
                               "messages": [{"role": "assistant", "audio": {"id": "audio_x"}}]})
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "messages[0].audio.id"


def test_spoken_turn_with_server_vad(rt_server):
    async def main():
        async with client(rt_server).realtime.connect(model=MODEL) as conn:
            await setup(conn, VAD)
            await append(conn, spoken_turn())
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


def test_barge_in_cancels_and_truncates(rt_server):
    """Speech while an answer plays cancels it (turn_detected): aborted in every stage, the item cut to the
    audio sent and the transcript of as many tokens as frames; then the spoken turn gets its answer."""
    long = {"max_output_tokens": 400, "max_audio_frames": 400}

    async def main():
        async with client(rt_server).realtime.connect(model=MODEL) as conn:
            await setup(conn, VAD)
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
