from __future__ import annotations

import asyncio
import base64
import io

import numpy as np
import openai
import pytest
import soundfile as sf
from fastapi.testclient import TestClient

from omnistage.config import DEPLOY_DIR
from omnistage.config_loader import load_deploy_config
from omnistage.outputs import SAMPLE_RATE, OutputDelta, Usage
from omnistage.server.app import _stream, create_app
from omnistage.server.audio_format import to_pcm16
from omnistage.server.metrics import ServerMetrics
from omnistage.server.protocol import ChatCompletionRequest
from omnistage.server.realtime.transcripts import TranscriptStore
from omnistage.server.responses import ResponseHead

TEXT = ["Hel", "lo", " there", "."]
# 4 codec frames first, then 25-frame chunks, then a partial tail (1920 samples per frame)
AUDIO = [np.random.default_rng(i).uniform(-0.9, 0.9, n).astype(np.float32)
         for i, n in enumerate([1920 * 4, 1920 * 25, 1920 * 3 + 555])]
USER = [{"role": "user", "content": "Say hello."}]


class FakeEngine:
    def __init__(self, fail_after: int | None = None) -> None:
        self.calls: list[dict] = []
        self.aborted: list[str] = []
        self.fail_after = fail_after

    async def generate(self, request_id, messages, sampling, talker_sampling, voice, use_audio_in_video, session=None):
        self.calls.append(dict(messages=messages, sampling=sampling, talker=talker_sampling, voice=voice,
                               session=session))
        texts = [OutputDelta(request_id, text=t) for t in TEXT]
        audios = [OutputDelta(request_id, audio=a) for a in AUDIO]
        items = [texts[0], audios[0], texts[1], audios[1], texts[2], audios[2], texts[3]]
        for i, item in enumerate(items):
            if i == self.fail_after:
                raise RuntimeError("device lost")
            await asyncio.sleep(0)
            yield item
        frames = sum(a.size for a in AUDIO) // 1920
        yield OutputDelta(request_id, finished=True, finish_reason="stop", usage=Usage(12, len(TEXT), frames))

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def setup(engine: FakeEngine | None = None):
    engine = engine or FakeEngine()
    deploy = load_deploy_config(DEPLOY_DIR / "qwen3_omni_moe.yaml", "cpu")
    metrics = ServerMetrics()
    app = create_app(engine, "qwen3-omni", deploy, ["chelsie", "ethan", "aiden"], metrics=metrics)
    http = TestClient(app)
    client = openai.OpenAI(api_key="x", base_url="http://testserver/v1", http_client=http, max_retries=0)
    return engine, client, http


def expected_pcm() -> bytes:
    return to_pcm16(np.concatenate(AUDIO)).tobytes()


def test_non_streaming_text_and_audio():
    engine, client, _ = setup()
    c = client.chat.completions.create(model="qwen3-omni", messages=USER, modalities=["text", "audio"],
                                       audio={"voice": "Chelsie", "format": "wav"}, temperature=0.0)
    m = c.choices[0].message
    assert m.content == "Hello there." and m.audio.transcript == "Hello there."
    pcm, sr = sf.read(io.BytesIO(base64.b64decode(m.audio.data)), dtype="int16")
    assert sr == SAMPLE_RATE and pcm.tobytes() == expected_pcm() and pcm.size == 1920 * 32 + 555
    assert c.usage.completion_tokens_details.audio_tokens == 32 and c.usage.prompt_tokens == 12
    call = engine.calls[0]
    assert call["voice"] == "chelsie"
    assert call["sampling"].temperature == 0.0 and call["sampling"].top_p == 0.9
    assert call["talker"].top_k == 50 and call["messages"] == [{"role": "user", "content": [
        {"type": "text", "text": "Say hello."}]}]
    assert engine.aborted == []


def test_text_only_request_ignores_audio():
    engine, client, _ = setup()
    c = client.chat.completions.create(model="qwen3-omni", messages=USER)
    assert c.choices[0].message.content == "Hello there." and c.choices[0].message.audio is None
    assert engine.calls[0]["talker"] is None and engine.calls[0]["voice"] is None


@pytest.mark.parametrize("fmt", ["wav", "pcm16"])
def test_stream_equals_whole(fmt):
    engine, client, http = setup()
    stream = client.chat.completions.create(model="qwen3-omni", messages=USER, modalities=["text", "audio"],
                                            audio={"voice": "ethan", "format": fmt}, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    deltas = [c.choices[0].delta.model_dump() for c in chunks if c.choices]
    audio = [d["audio"] for d in deltas if d.get("audio")]
    data = b"".join(base64.b64decode(a["data"]) for a in audio if a.get("data"))
    assert text == "Hello there."
    assert [bool(a.get("id")) for a in audio] == [True, False, False, False]
    assert audio[-1]["expires_at"] > 0 and [c.choices[0].finish_reason for c in chunks[-2:-1]] == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(TEXT) + 32
    if fmt == "wav":
        pcm, sr = sf.read(io.BytesIO(data), dtype="int16")
        data = pcm.tobytes()
    assert data == expected_pcm()
    metrics = http.get("/metrics").text
    assert "omnistage_time_to_first_audio_seconds_count 1" in metrics
    assert 'omnistage_requests_total{endpoint="/v1/chat/completions",status="200"} 1' in metrics


def test_stream_failure_is_reported_in_stream_and_aborts():
    engine, _, http = setup(FakeEngine(fail_after=3))
    body = {"messages": USER, "modalities": ["audio"], "audio": {"format": "pcm16"}, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        frames = [line for line in r.iter_lines() if line]
    assert r.status_code == 200 and frames[-1] == "data: [DONE]"
    assert frames[-2] == ('data: {"error":{"message":"The server had an error while processing your '
                          'request.","type":"server_error","param":null,"code":null}}')
    assert len(engine.aborted) == 1


def test_disconnect_mid_stream_aborts_the_request():
    engine = FakeEngine()
    req = ChatCompletionRequest.model_validate({"messages": USER, "modalities": ["audio"], "stream": True,
                                                "audio": {"format": "pcm16"}})
    head = ResponseHead(model="m")

    async def run() -> None:
        from omnistage.server.serving import RequestClock

        deltas = engine.generate(head.id, [], None, None, None, False)
        body = _stream(req, head, deltas, engine, RequestClock(), ServerMetrics(), TranscriptStore())
        await body.__anext__()
        await body.__anext__()
        await body.aclose()  # what the server does when the client goes away

    asyncio.run(run())
    assert engine.aborted == [head.id]


def test_unknown_model_and_audio_reference():
    _, client, http = setup()
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=USER)
    history = USER + [{"role": "assistant", "audio": {"id": "a"}}]
    r = http.post("/v1/chat/completions", json={"messages": history})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[1].audio.id"
    assert "no audio answer 'a' is stored" in r.json()["error"]["message"]
    assert http.get("/v1/models").json()["data"][0]["id"] == "qwen3-omni"


@pytest.mark.parametrize("stream", [False, True])
def test_audio_reference_becomes_the_transcript(stream):
    """An answer's message.audio.id (streamed or not) stands for its transcript in a later request."""
    engine, client, _ = setup()
    audio = {"voice": "ethan", "format": "pcm16" if stream else "wav"}
    reply = client.chat.completions.create(model="qwen3-omni", messages=USER, modalities=["text", "audio"],
                                           audio=audio, stream=stream)
    chunks = list(reply) if stream else []  # the transcript is stored once the answer is whole
    audio_id = (next(c.choices[0].delta.audio.id for c in chunks if c.choices and c.choices[0].delta.audio)
                if stream else reply.choices[0].message.audio.id)
    history = [*USER, {"role": "assistant", "audio": {"id": audio_id}}, {"role": "user", "content": "Again."}]
    client.chat.completions.create(model="qwen3-omni", messages=history)
    assert engine.calls[-1]["messages"][1] == {"role": "assistant",
                                               "content": [{"type": "text", "text": "Hello there."}]}


def test_health_tells_which_replica_is_down():
    engine, client, http = setup()
    assert http.get("/health").json() == {"status": "ok"}
    engine.health = lambda: {"status": "degraded", "replicas": {"talker1": "restarting"}}
    r = http.get("/health")
    assert r.status_code == 200 and r.json() == {"status": "degraded", "replicas": {"talker1": "restarting"}}
    engine.health = lambda: {"status": "unavailable", "replicas": {"thinker": "restarting"}}
    r = http.get("/health")
    assert r.status_code == 503 and r.json()["replicas"] == {"thinker": "restarting"}


def test_prompt_cache_key_is_the_request_session():
    engine, client, _ = setup()
    client.chat.completions.create(model="qwen3-omni", messages=USER, prompt_cache_key="conv-7")
    client.chat.completions.create(model="qwen3-omni", messages=USER)
    assert [c["session"] for c in engine.calls] == ["conv-7", None]
