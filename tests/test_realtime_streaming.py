"""/v1/realtime's streaming input and its session extensions, on the realtime tests' server
(realtime_helpers.py): a long spoken turn prefilled while spoken equal to chat, the 16 kHz audio streamed
equal to the committed clip's, the turn's open request freed on every path that leaves it, ignore_eos."""

from __future__ import annotations

import asyncio
import io
import time

import httpx
import numpy as np
import pytest
import soundfile as sf
from serve_process import MODEL, samples
from realtime_helpers import (MANUAL, TURN, answer, append, assert_nothing_held, b64, chat, chat_audio,
                             client, counter, long_speech_pcm, say, scored, setup, silence, speech_pcm,
                             until, wait_held)

pytest_plugins = ["realtime_helpers"]


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


@pytest.mark.parametrize("placement", ["local", "pipeline"])
def test_long_spoken_turn_prefilled_while_spoken_equals_chat(request, placement: str):
    """A 17.5 s turn sent in 20-40 ms appends: its request is opened at speech start (again at each pause
    spoken on from: `EarlyPrefill.resume`) and its two complete encoder windows (104 rows each) are prefilled
    before the turn ends (and kept), the rest where the silence began; the answer is that of the committed
    clip through chat completions (same transcript, audio bytes and usage). With `placement: pipeline` the
    stages run in a worker process: the same."""
    rt_server = request.getfixturevalue("rt_server" if placement == "local" else "rt_pipeline_server")
    pcm = silence(400) + long_speech_pcm()
    rows, prepared = "omnistage_realtime_streamed_prompt_rows_total", "omnistage_realtime_prepared_turns_total"
    before, prepared_before = counter(rt_server, rows), counter(rt_server, prepared)
    phases_before = phase_totals(rt_server)

    async def main():
        async with client(rt_server).realtime.connect(model=MODEL) as conn:
            await setup(conn, {**LONG_TURN, "instructions": "Be brief."})
            for piece in pieces(pcm):
                await conn.input_audio_buffer.append(audio=b64(piece))
            # NOTE: the last reopening must be behind us, not in the VAD's backlog when the silence comes
            heard = await scored(conn)
            wait_held(rt_server, (2 * 104 + 12) // 16 + 1)  # KV of the prefix and both windows (16 a block)
            await append(conn, silence(1500), 960)
            return heard + await until(conn, "response.done")

    events = asyncio.run(main())
    started, stopped = events[0], events[1]
    assert (started.type, stopped.type) == ("input_audio_buffer.speech_started",
                                            "input_audio_buffer.speech_stopped")
    clip = (pcm + silence(1500))[started.audio_start_ms * 48:stopped.audio_end_ms * 48]
    assert len(clip) // 2 * 2 // 3 // 160 >= 1600  # two complete windows of 800 mel frames
    assert counter(rt_server, rows) - before == 2 * 104
    assert counter(rt_server, prepared) - prepared_before == 1  # prepared where the user paused: one row at close
    assert_turn_phases(rt_server, phases_before)
    text, audio, response = answer(events)
    reply = chat(rt_server, wav_messages(clip, "Be brief."))
    assert chat_audio(reply) == (text, audio) and len(audio) == 2 * samples(4)
    assert reply["usage"]["prompt_tokens"] == response.usage.input_tokens
    assert_nothing_held(rt_server)


def phase_totals(server) -> dict[str, dict[str, float]]:
    from omnistage.bench.stage_stats import parse_phase_totals
    return parse_phase_totals(httpx.get(server.url + "/metrics").text)


def finished(totals: dict) -> float:
    return totals.get("first_audio", {}).get("count", 0)


def assert_turn_phases(server, before: dict) -> None:
    """The turn's request (the one request that finished since `before`) reached turn_end (the VAD's
    decision), and close then closed (its closing piece sent) before its first token. Close may precede
    turn_end: a preempted response (`realtime_preemptive_response`) closes at the user's pause, and here the
    VAD's decision follows the pause by less than its scoring takes."""
    from omnistage.bench.stage_stats import phase_means
    deadline = time.monotonic() + 5  # the metrics see the request just after response.done goes out
    while finished(phase_totals(server)) == finished(before):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    after = phase_totals(server)
    for phase in ("turn_end", "close", "closed", "first_token"):
        assert after[phase]["count"] - before.get(phase, {}).get("count", 0) == 1, phase
    means = phase_means(before, after)
    assert means["thinker_start"] < min(means["turn_end"], means["close"])
    assert means["close"] <= means["closed"] <= means["first_token"]


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
    from omnistage.config import DEPLOY_DIR
    from omnistage.config_loader import load_deploy_config
    from omnistage.server.realtime.events import ResponseParams
    from omnistage.server.realtime.settings import Resolved, initial, updated

    deploy = load_deploy_config(DEPLOY_DIR / "qwen3_omni_moe.yaml", platform="cpu")
    session = updated(initial(["Ethan"], MODEL), {"ignore_eos": True}, ["Ethan"], MODEL)
    sampling, talker = Resolved(session, ResponseParams(), ["Ethan"]).sampling(deploy)
    assert sampling.ignore_eos and talker.ignore_eos
    sampling, talker = Resolved(session, ResponseParams(ignore_eos=False), ["Ethan"]).sampling(deploy)
    assert not sampling.ignore_eos and not talker.ignore_eos
