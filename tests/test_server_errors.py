"""Invalid requests against the real server: each gets its OpenAI-shaped 4xx, the server stays healthy;
--api-key; client disconnects abort the request; /metrics."""

from __future__ import annotations

import base64
import re
import time

import httpx
import openai
import pytest

from serve_process import KEY, MODEL, USER

pytest_plugins = ["serve_fixtures"]


def user(*parts: dict, role: str = "user") -> list[dict]:
    return [{"role": role, "content": list(parts)}]


def audio_part(data: str) -> list[dict]:
    return user({"type": "input_audio", "input_audio": {"data": data, "format": "wav"}})


AUDIO = {"modalities": ["text", "audio"]}
BAD_CHAT = [
    ({**AUDIO, "audio": {"voice": "nobody"}}, 400, "audio.voice"),
    ({**AUDIO, "audio": {"format": "aac"}}, 400, "audio.format"),
    ({**AUDIO, "audio": {"format": "mp3"}, "stream": True}, 400, "audio.format"),
    ({**AUDIO, "n": 2}, 400, "n"),
    ({"n": 3}, 400, "n"),  # text only too: never fewer choices than asked
    ({"messages": []}, 400, "messages"),
    ({"temperature": "hot"}, 400, "temperature"),
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"frobnicate": 1}, 400, "frobnicate"),
    ({"model": "gpt-4o"}, 404, "model"),
    ({"messages": audio_part("not base64!!")}, 400, "messages[0].content[0]"),
    ({"messages": audio_part(base64.b64encode(b"not audio").decode())}, 400, "messages[0].content[0]"),
    ({"messages": user({"type": "audio_url", "audio_url": {"url": "file:///etc/hosts"}})}, 400, "messages[0].content[0]"),
    ({"messages": user({"type": "audio", "audio": "ftp://x/a.wav"})}, 400, "messages[0].content[0]"),
    ({"messages": user({"type": "image_url", "image_url": {"url": "http://x/a.png"}})}, 400, "messages[0].content[0]"),
    ({"messages": user({"type": "hologram"})}, 400, "messages[0].content[0]"),
    ({"messages": user({"type": "text", "text": "x"}, role="bot")}, 400, "messages[0].role"),
    ({"messages": user({"type": "audio", "audio": "data:,"}, role="system")}, 400, "messages[0]"),
    ({"messages": [{"role": "user"}]}, 400, "messages[0]"),
    ({"messages": "hi"}, 400, "messages"),
    ({"messages": USER + [{"role": "assistant", "audio": {"id": "audio_1"}}]}, 400, "messages[1].audio.id"),
    ({"modalities": ["video"]}, 400, "modalities[0]"),
    ({"top_p": 0}, 400, "top_p"),
    ({"n": 0}, 400, "n"),
    ({"stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"audio": {"voice": "ethan"}}, 400, "audio"),
    ({**AUDIO, "max_audio_frames": 5, "talker": {"max_frames": 5}}, 400, "max_audio_frames"),
    ({**AUDIO, "talker": {"temperature": -1}}, 400, "talker.temperature"),
]
BAD_SPEECH = [
    ({"voice": "nobody"}, 400, "voice"),
    ({"response_format": "aac"}, 400, "response_format"),
    ({"response_format": "mp3", "stream": True}, 400, "response_format"),
    ({"input": ""}, 400, "input"),
    ({"speed": 2.0}, 400, "speed"),
    ({"stream_format": "sse"}, 400, "stream_format"),
    ({"input": 5}, 400, "input"),
    ({"max_audio_frames": 0}, 400, "max_audio_frames"),
    ({"foo": 1}, 400, "foo"),
    ({"model": "tts-1"}, 404, "model"),
]


BAD = BAD_CHAT + [(dict(b, speech=1), s, p) for b, s, p in BAD_SPEECH]


@pytest.mark.parametrize("body, status, param", BAD)
def test_invalid_requests(server, body, status, param):
    body = dict(body)
    if body.pop("speech", None):
        url, body = "/v1/audio/speech", {"input": "Hi.", **body}
    else:
        url, body = "/v1/chat/completions", {"messages": USER, "max_tokens": 2, **body}
    r = httpx.post(server.url + url, json=body, timeout=60)
    error = r.json()["error"]
    assert (r.status_code, error["param"]) == (status, param), error
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    if param in ("voice", "audio.voice"):
        assert "aiden, chelsie, ethan" in error["message"]


def test_malformed_json(server):
    r = httpx.post(server.url + "/v1/chat/completions", content=b'{"messages": [', timeout=10,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


def test_api_key(keyed_server):
    body = {"messages": USER, "max_tokens": 2}
    assert httpx.post(keyed_server.url + "/v1/chat/completions", json=body).status_code == 401
    wrong = {"Authorization": "Bearer nope"}
    assert httpx.get(keyed_server.url + "/v1/models", headers=wrong).json()["error"]["code"] == "invalid_api_key"
    client = openai.OpenAI(base_url=keyed_server.url + "/v1", api_key=KEY, max_retries=0)
    reply = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2)
    assert reply.usage.completion_tokens == 2
    assert httpx.get(keyed_server.url + "/health").status_code == 200


def aborts(server) -> int:
    return server.log.read_text().count("stopped before it finished")


def test_disconnect_aborts(server):
    long = {"messages": USER, "max_tokens": 4000, "modalities": ["text", "audio"], "max_audio_frames": 4000}
    before = aborts(server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/chat/completions", json=long, timeout=1.5)
    stream = {**long, "stream": True, "audio": {"format": "pcm16"}}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=stream, timeout=30) as r:
        next(line for line in r.iter_lines() if '"audio"' in line)
    deadline = time.monotonic() + 10
    while aborts(server) < before + 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert aborts(server) == before + 2


def test_metrics_and_still_healthy(server, client):
    client.chat.completions.create(model=MODEL, messages=USER, modalities=["text", "audio"], max_tokens=2,
                                   audio={"voice": "Ethan", "format": "wav"},
                                   extra_body={"max_audio_frames": 2})  # every histogram has a sample
    text = httpx.get(server.url + "/metrics").text
    for name in ("time_to_first_token_seconds", "time_to_first_audio_seconds", "audio_rtf",
                 "e2e_request_latency_seconds"):
        assert f"# TYPE omnistage_{name} histogram" in text and f"omnistage_{name}_count" in text
    assert re.search(r'omnistage_requests_total\{endpoint="/v1/chat/completions",status="400"\} (\d+)', text)
    assert 'endpoint="/v1/chat/completions",status="499"' in text
    for stage in ("thinker", "talker"):  # the engine's gauges, read at scrape time
        total = re.search(rf'omnistage_kv_cache_blocks_total\{{stage="{stage}"\}} (\d+)', text)
        assert total and int(total.group(1)) > 0
        assert f'omnistage_kv_cache_blocks_in_use{{stage="{stage}"}}' in text
    assert 'omnistage_stage_queue_depth{stage="code2wav"}' in text
    reply = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=3)
    assert reply.usage.completion_tokens == 3
