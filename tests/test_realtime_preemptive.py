"""Deploy `realtime_preemptive_response` (on by default): a spoken turn's response starts where the user pauses
(server VAD's `speech_paused`), its events held until the VAD ends the turn there; speech after the pause drops it
(`speech_resumed`) and the turn goes on. Either way, and with it off, the answer is the committed clip's through
chat completions."""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest
from realtime_helpers import (TURN, answer, append, assert_nothing_held, b64, chat, chat_audio, client, setup,
                              shape, silence, speech_pcm, until)
from serve_process import MODEL
from test_realtime_streaming import wav_messages

from omnistage.server.realtime.turns import ServerVad, TurnState

pytest_plugins = ["realtime_helpers"]
PREEMPT = "omnistage_realtime_preemptive_responses_total"
SESSION = {"type": "realtime", **TURN, "instructions": "Be brief.",
           "audio": {"input": {"turn_detection": {"type": "server_vad", "silence_duration_ms": 800}}}}


def test_speech_after_a_reported_pause_resumes_the_turn() -> None:
    state, w = TurnState(ServerVad()), 512  # silero windows: 32 ms
    probs = [0.9] * 10 + [0.0] * 6 + [0.9] * 5 + [0.0] * 16 + [0.9] * 3
    events = [e for i, p in enumerate(probs) if (e := state.step(i * w, (i + 1) * w, p))]
    assert [(e.type, e.audio_ms) for e in events] == [
        ("speech_started", 0), ("speech_paused", 320), ("speech_resumed", 512), ("speech_paused", 672),
        ("speech_stopped", 672), ("speech_started", 884)]  # a new turn after the stop: not a resume


def preempted(server) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics").text
    return {m.group(1): float(m.group(2)) for m in re.finditer(rf'{PREEMPT}\{{outcome="(\w+)"\}} (\S+)', text)}


async def in_real_time(conn, pcm: bytes) -> None:
    """Appended 40 ms at a time, as a microphone sends it (the VAD's pause comes well before its stop)."""
    for i in range(0, len(pcm), 1920):
        await conn.input_audio_buffer.append(audio=b64(pcm[i:i + 1920]))
        await asyncio.sleep(0.04)


def spoken(rt_server, *parts: bytes) -> tuple[list, bytes, dict[str, float]]:
    """The session's events to the turn's response.done (`parts` appended at once, silence in real time), the
    committed clip, the preemptive counts' change."""
    before, pcm = preempted(rt_server), b"".join(parts)

    async def main():
        async with client(rt_server).realtime.connect(model=MODEL) as conn:
            await setup(conn, SESSION)
            for part in parts:
                await (in_real_time(conn, part) if not any(part) else append(conn, part, 1920))
            return await until(conn, "response.done")

    events = asyncio.run(main())
    started, stopped = events[0], next(e for e in events if e.type == "input_audio_buffer.speech_stopped")
    clip = pcm[started.audio_start_ms * 48:stopped.audio_end_ms * 48]
    after = preempted(rt_server)
    return events, clip, {k: after.get(k, 0) - before.get(k, 0) for k in ("used", "dropped")}


def assert_answer_is_the_clips(server, events: list, clip: bytes) -> None:
    text, audio, response = answer(events)
    reply = chat(server, wav_messages(clip, "Be brief."))
    assert chat_audio(reply) == (text, audio) and audio
    assert reply["usage"]["prompt_tokens"] == response.usage.input_tokens


@pytest.mark.parametrize("server", ["rt_server", "rt_pipeline_server", "rt_unpreempted_server"])
def test_a_turn_ending_at_its_pause_gets_the_response_started_there(request, server: str):
    used = int(server != "rt_unpreempted_server")
    server = request.getfixturevalue(server)
    events, clip, counts = spoken(server, silence(500), speech_pcm(), silence(1200))
    assert counts == {"used": used, "dropped": 0}
    assert shape(events)[:4] == ["input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
                                 "input_audio_buffer.committed", "conversation.item.added"]
    assert_answer_is_the_clips(server, events, clip)
    assert_nothing_held(server)


def test_speech_after_the_pause_drops_the_response_started_there(rt_server):
    speech = speech_pcm()
    events, clip, counts = spoken(rt_server, silence(500), speech, silence(300), speech, silence(1200))
    assert counts["used"] == 1 and counts["dropped"] >= 1  # the 300 ms pause (and any inside the speech)
    assert [e.type for e in events].count("input_audio_buffer.speech_stopped") == 1
    assert len(clip) > 2 * len(speech)  # both sentences are the turn
    assert_answer_is_the_clips(rt_server, events, clip)
    assert_nothing_held(rt_server)
