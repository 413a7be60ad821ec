"""/v1/realtime through the official openai SDK's realtime client (realtime_helpers.py's server): a user
item's `input_image` (the same tokens and codes as the same image sent to chat completions; bad images are
error events and the session goes on), input audio transcription (the transcript is what the same text-only
chat request for that audio answers; none when off; a refused one is a .failed event, one running when the
session closes is aborted), and the server's timings in response.done's metadata."""

from __future__ import annotations

import asyncio
import io
from types import SimpleNamespace

import httpx
import numpy as np
import soundfile as sf
from PIL import Image
from realtime_helpers import (MANUAL, VAD, answer, append, b64, chat, chat_audio, client, setup, speech_pcm,
                              spoken_turn, until)
from serve_process import KEY, MODEL, samples

from omnistage.server.realtime.conversation import Item, Part
from omnistage.server.realtime.settings import SessionSettings, updated
from omnistage.server.realtime.transcription import INSTRUCTION, Transcriber

pytest_plugins = ["realtime_helpers"]
COMPLETED = "conversation.item.input_audio_transcription.completed"


def png_url(image: Image.Image) -> str:
    out = io.BytesIO()
    image.save(out, "PNG")
    return "data:image/png;base64," + b64(out.getvalue())


def image_item(url: str, text: str = "What is in the picture?") -> dict:
    return {"type": "message", "role": "user",
            "content": [{"type": "input_text", "text": text}, {"type": "input_image", "image_url": url,
                                                                "detail": "low"}]}


async def until_all(conn, kinds: set[str], limit: float = 60) -> list:
    out = []
    async with asyncio.timeout(limit):
        while not kinds <= {e.type for e in out}:
            out.append(await conn.recv())
    return out


def test_image_item_equals_chat(rt_server):
    rng = np.random.default_rng(0)
    url = png_url(Image.fromarray(rng.integers(0, 256, (40, 56, 3), dtype=np.uint8)))
    huge = png_url(Image.new("1", (6000, 6000)))  # 36 M pixels, more than the policy's 32 M
    bad = {"data:image/png;base64,!!!!": "invalid base64 data",
           "data:image/png;base64," + b64(b"not an image"): "cannot decode image",
           huge: "image is 6000x6000, more than 32000000 pixels",
           "https://example.com/cat.png": "a data: URL of base64 image bytes is required "
                                          "(data:image/png;base64,...)"}

    async def main():
        async with client(rt_server).realtime.connect(model=MODEL) as conn:
            await setup(conn, MANUAL)
            for i, (wrong, message) in enumerate(bad.items()):
                await conn.send({"type": "conversation.item.create", "event_id": f"evt_{i}",
                                 "item": image_item(wrong)})
                error = (await conn.recv()).error
                assert (error.param, error.event_id) == ("item.content[1].image_url", f"evt_{i}")
                assert error.message == f"item.content[1].image_url: {message}"
                assert error.type == "invalid_request_error"
            await conn.conversation.item.create(item=image_item(url))
            added, done = await conn.recv(), await conn.recv()
            assert (added.type, done.type) == ("conversation.item.added", "conversation.item.done")
            content = [(c.type, c.detail) for c in done.item.content]
            assert content == [("input_text", None), ("input_image", "low")]
            await conn.response.create()
            return answer(await until(conn, "response.done"))

    text, audio, response = asyncio.run(main())
    image = {"type": "image_url", "image_url": {"url": url}}
    reply = chat(rt_server, [{"role": "user", "content": [{"type": "text", "text": "What is in the picture?"},
                                                          image]}])
    assert chat_audio(reply) == (text, audio) and len(audio) == 2 * samples(4)
    text_only = chat(rt_server, [{"role": "user", "content": "What is in the picture?"}])
    prompt = reply["usage"]["prompt_tokens"]
    assert prompt == response.usage.input_tokens > text_only["usage"]["prompt_tokens"]
    assert reply["usage"]["completion_tokens"] == response.usage.output_tokens == 8


def transcribe_by_chat(server, pcm: bytes, max_tokens: int) -> str:
    wav = io.BytesIO()
    sf.write(wav, np.frombuffer(pcm, "<i2"), 24000, format="WAV", subtype="PCM_16")
    body = {"model": MODEL, "modalities": ["text"], "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "system", "content": INSTRUCTION}, {"role": "user", "content": [
                {"type": "input_audio", "input_audio": {"data": b64(wav.getvalue()), "format": "wav"}}]}]}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                   timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_input_transcription(rt_server):
    """On: the committed audio's transcript (deltas, completed, kept on the item) runs beside the answer;
    off (session.update with null): no transcription events."""
    pcm = speech_pcm()
    on = {"input": {"turn_detection": None, "transcription": {"model": "whisper-1", "language": None}}}

    async def main():
        async with client(rt_server).realtime.connect(model=MODEL) as conn:
            await setup(conn, {**MANUAL, "audio": on, "max_output_tokens": 6})
            await append(conn, pcm)
            await conn.input_audio_buffer.commit()
            await conn.response.create(response={"output_modalities": ["text"]})
            events = await until_all(conn, {"response.done", COMPLETED})
            committed = next(e for e in events if e.type == "input_audio_buffer.committed")
            await conn.conversation.item.retrieve(item_id=committed.item_id)
            retrieved = (await until(conn, "conversation.item.retrieved"))[-1]
            off = {"type": "realtime", "audio": {"input": {"transcription": None}}}
            await conn.session.update(session=off)
            assert (await conn.recv()).session.audio.input.transcription is None
            await append(conn, pcm)
            await conn.input_audio_buffer.commit()
            await conn.response.create(response={"output_modalities": ["text"]})
            return events, retrieved, await until(conn, "response.done")

    events, retrieved, off = asyncio.run(main())
    expected = transcribe_by_chat(rt_server, pcm, 6)
    completed = next(e for e in events if e.type == COMPLETED)
    deltas = [e for e in events if e.type == "conversation.item.input_audio_transcription.delta"]
    item_id = events[0].item_id
    assert completed.transcript == "".join(e.delta for e in deltas) == expected and len(deltas) >= 1
    assert {(e.item_id, e.content_index) for e in [*deltas, completed]} == {(item_id, 0)}
    assert completed.usage.type == "tokens" and 0 < completed.usage.output_tokens <= 6
    assert completed.usage.total_tokens == completed.usage.input_tokens + completed.usage.output_tokens
    assert retrieved.item.id == item_id and retrieved.item.content[0].transcript == expected
    assert not [e for e in off if "transcription" in e.type] and off[-1].response.status != "failed"


def test_server_timings_in_response_done(rt_server):
    """A server VAD turn's response.done carries the server's speech_stopped -> first audio, created -> first
    audio and RTF; a response.create'd one all but the first."""
    async def main():
        async with client(rt_server).realtime.connect(model=MODEL) as conn:
            await setup(conn, VAD)
            await append(conn, spoken_turn())
            spoken = await until(conn, "response.done")
            await conn.response.create(response={"metadata": {"mine": "kept"}})
            return spoken, await until(conn, "response.done")

    spoken, asked = asyncio.run(main())
    for events, keys in ((spoken, {"omnistage_vad_to_first_audio_ms", "omnistage_first_audio_ms",
                                   "omnistage_rtf"}),
                         (asked, {"mine", "omnistage_first_audio_ms", "omnistage_rtf"})):
        _, audio, response = answer(events)
        assert set(response.metadata) == keys and len(audio) == 2 * samples(4)
        first = float(response.metadata["omnistage_first_audio_ms"])
        rtf = float(response.metadata["omnistage_rtf"])
        # the answer's audio (4 frames, 0.3 s) took at least its first audio's time: RTF >= that / 0.3 s
        assert 0 < first and rtf >= first / 1000 / (len(audio) / 2 / 24000) > 0
    vad = float(spoken[-1].response.metadata["omnistage_vad_to_first_audio_ms"])
    assert vad >= float(spoken[-1].response.metadata["omnistage_first_audio_ms"]) > 0
    assert asked[-1].response.metadata["mine"] == "kept"


class FakeEngine:
    """Refuses every request (as the engine refuses bad media), or holds it until aborted."""

    def __init__(self, refuse: Exception | None = None) -> None:
        self.refuse, self.aborted, self.started = refuse, [], asyncio.Event()

    async def generate(self, request_id, messages, sampling, talker, voice, use_audio_in_video, session=None):
        assert talker is None and voice is None and sampling.greedy and sampling.max_tokens == 5
        assert messages[0]["content"][0]["text"].startswith(INSTRUCTION + " The speech is in en.")
        self.started.set()
        if self.refuse is not None:
            raise self.refuse
        await asyncio.Event().wait()
        yield

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def test_transcription_failed_and_closed():
    """A refused transcription is a .failed event for the item; a session closed while one runs aborts it."""
    settings = updated(SessionSettings(output_modalities=["text"], max_output_tokens=5),
                       {"audio": {"input": {"transcription": {"language": "en"}}}}, [], MODEL)
    item = Item("item_1", "user", [Part("input_audio", pcm=speech_pcm()[:4800])])

    async def run(engine: FakeEngine) -> list[dict]:
        sent = []
        ctx = SimpleNamespace(engine=engine, deploy=SimpleNamespace(stages=SimpleNamespace(
            thinker=SimpleNamespace(sampling={}))))
        transcriber = Transcriber(ctx, lambda e: asyncio.sleep(0, sent.append(e)))
        transcriber.start(item, settings)
        await engine.started.wait()
        await asyncio.sleep(0.01)
        await transcriber.close()
        return sent

    refused = FakeEngine(ValueError("audio: cannot decode audio"))
    [failed] = asyncio.run(run(refused))
    assert (failed["type"], failed["item_id"], failed["content_index"]) == (
        "conversation.item.input_audio_transcription.failed", "item_1", 0)
    assert failed["error"] == {"type": "invalid_request_error", "code": None,
                               "message": "audio: cannot decode audio", "param": None}
    assert len(refused.aborted) == 1 and item.parts[0].transcript is None
    held = FakeEngine()
    assert asyncio.run(run(held)) == [] and len(held.aborted) == 1
