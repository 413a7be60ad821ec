from __future__ import annotations

from dataclasses import asdict

import openai
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from omnistage.config import DEPLOY_DIR
from omnistage.config_loader import load_deploy_config
from omnistage.server.errors import install_api_key, install_error_handlers, model_not_found
from omnistage.server.protocol import (
    ChatCompletionRequest,
    SpeechRequest,
    resolve_voice,
    talker_sampling_params,
    thinker_sampling_params,
)

VOICES = ("chelsie", "ethan", "aiden")
DEPLOY = load_deploy_config(DEPLOY_DIR / "qwen3_omni_moe.yaml", "cpu")
USER = [{"role": "user", "content": "Say hi."}]


def make_app(api_key: str | None = None) -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)
    install_api_key(app, api_key)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest) -> dict:
        if req.model not in (None, "qwen3-omni"):
            raise model_not_found(req.model)
        audio, stages = req.wants_audio, DEPLOY.stages
        return {"thinker": asdict(thinker_sampling_params(req, stages.thinker.sampling)),
                "talker": asdict(talker_sampling_params(req, stages.talker.sampling)) if audio else None,
                "voice": resolve_voice(req.audio.voice, VOICES) if audio else None,
                "format": req.audio.format if audio else None, "modalities": req.modalities}

    @app.post("/v1/audio/speech")
    async def speech(req: SpeechRequest) -> dict:
        return {"voice": resolve_voice(req.voice, VOICES, param="voice"), "format": req.response_format}

    @app.get("/v1/boom")
    async def boom() -> None:
        raise RuntimeError("secret /home/me/weights detail")

    @app.get("/health")
    async def health() -> dict:
        return {}

    return app


CLIENT = TestClient(make_app())


def post(body: dict, path: str = "/v1/chat/completions"):
    return CLIENT.post(path, json=body)


def test_deploy_defaults_then_request_fields():
    got = post({"model": "qwen3-omni", "messages": USER}).json()
    t = got["thinker"]
    got_t = (t["temperature"], t["top_p"], t["top_k"], t["repetition_penalty"], t["max_tokens"])
    assert got_t == (0.4, 0.9, 1, 1.05, 2048)
    assert got["modalities"] == ["text"] and got["talker"] is None

    got = post({"messages": USER, "temperature": 0, "max_tokens": 9, "max_completion_tokens": 7, "stop": "\n",
                "seed": 5, "min_p": 0.1, "stop_token_ids": [151645], "ignore_eos": True,
                "modalities": ["audio"], "audio": {"voice": "CHELSIE", "format": "pcm16"},
                "talker": {"temperature": 0.0, "top_k": 3},
                "max_audio_frames": 120}).json()
    t, k = got["thinker"], got["talker"]
    assert (t["temperature"], t["max_tokens"], t["stop"], t["seed"], t["min_p"]) == (0.0, 7, ["\n"], 5, 0.1)
    assert (t["stop_token_ids"], t["ignore_eos"], t["top_p"]) == ([151645], True, 0.9)
    got_k = (k["temperature"], k["top_k"], k["max_frames"], k["seed"], k["repetition_penalty"])
    assert got_k == (0.0, 3, 120, 5, 1.05)
    assert got["modalities"] == ["text", "audio"] and got["voice"] == "chelsie" and got["format"] == "pcm16"

    got = post({"messages": USER, "modalities": ["text", "audio"], "seed": 5, "talker": {"seed": 9}}).json()
    assert got["talker"]["seed"] == 9 and got["voice"] == "ethan" and got["format"] == "wav"


@pytest.mark.parametrize("body, param, message", [
    ({"messages": USER, "temperature": -1},
     "temperature", "temperature: Input should be greater than or equal to 0"),
    ({"messages": USER, "frobnicate": 1}, "frobnicate", "Unrecognized request argument supplied: frobnicate"),
    ({"messages": []}, "messages", "messages: List should have at least 1 item"),
    ({}, "messages", "messages: Field required"),
    ({"messages": USER, "modalities": ["video"]},
     "modalities[0]", "modalities[0]: Input should be 'text' or 'audio'"),
    ({"messages": USER, "modalities": ["audio"], "n": 2}, "n", "n: only 1 is supported (one choice a request)"),
    ({"messages": USER, "n": 2}, "n", "n: only 1 is supported"),
    ({"messages": USER, "audio": {"voice": "ethan"}},
     "audio", "audio: given, but modalities does not include"),
    ({"messages": USER, "modalities": ["audio"], "audio": {"format": "aac"}}, "audio.format",
     "audio.format: 'aac' is not supported for audio; supported: wav, "),
    ({"messages": USER, "modalities": ["audio"], "audio": {"format": "ogg"}}, "audio.format",
     "audio.format: Input should be 'wav', 'mp3', 'flac', 'opus', 'aac', 'pcm16' or 'pcm'"),
    ({"messages": USER, "modalities": ["audio"], "stream": True, "audio": {"format": "flac"}}, "audio.format",
     "audio.format: 'flac' is not supported for streamed audio; supported: wav, pcm16, pcm"),
    ({"messages": USER, "modalities": ["audio"], "audio": {"voice": "alloy"}}, "audio.voice",
     "audio.voice: unknown voice 'alloy'; available: aiden, chelsie, ethan"),
    ({"messages": USER, "stream_options": {"include_usage": True}},
     "stream_options", "stream_options: only allowed"),
    ({"messages": USER, "stream": True, "stream_options": {"include_usage": "yes"}},
     "stream_options.include_usage", "stream_options.include_usage: Input should be a valid boolean"),
    ({"messages": USER, "stream": 1}, "stream", "stream: Input should be a valid boolean"),
    ({"input": "Hi", "stream": "true"}, "stream", "stream: Input should be a valid boolean"),
    ({"messages": USER, "max_audio_frames": 5, "talker": {"max_frames": 6}},
     "max_audio_frames", "max_audio_frames: give"),
    ({"messages": USER, "talker": {"top_p": 1.5}},
     "talker.top_p", "talker.top_p: Input should be less than or equal to 1"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0].image_url.url", "messages[0].content[0].image_url.url: Field required"),
    ({"messages": [{"role": "user", "content": [{"type": "video", "video": "a.mp4", "fps": 0}]}]},
     "messages[0].content[0].fps", "messages[0].content[0].fps: Input should be greater than 0"),
    ({"messages": [{"role": "user", "content": [{"type": "hologram"}]}]}, "messages[0].content[0]",
     "messages[0].content[0]: Input tag 'hologram' found using 'type' does not match"),
    ({"messages": [{"role": "system", "content": [{"type": "image", "image": "x.png"}]}]}, "messages[0]",
     "messages[0]: system messages take text content only"),
    ({"messages": [{"role": "robot", "content": "x"}]},
     "messages[0].role", "messages[0].role: Input should be"),
    ({"model": "gpt-4o", "messages": USER}, "model", "The model `gpt-4o` does not exist."),
    ({"input": "Hi", "speed": 1.5}, "speed", "speed: only 1.0 is supported, got 1.5"),
    ({"input": "Hi", "response_format": "aac"}, "response_format", "response_format: 'aac' is not supported"),
    ({"input": "Hi", "response_format": "mp3", "stream": True}, "response_format",
     "response_format: 'mp3' is not supported for streamed audio"),
    ({"input": "Hi", "voice": "nova"}, "voice", "voice: unknown voice 'nova'"),
    ({"input": ""}, "input", "input: String should have at least 1 character"),
])
def test_errors_are_openai_shaped(body, param, message):
    path = "/v1/audio/speech" if "input" in body else "/v1/chat/completions"
    r = post(body, path)
    err = r.json()["error"]
    assert r.status_code == (404 if param == "model" else 400)
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert err["message"].startswith(message), err["message"]


def test_content_parts_accepted():
    parts = [{"type": "text", "text": "What is this?"},
             {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA", "detail": "low"}},
             {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
             {"type": "audio_url", "audio_url": {"url": "https://x/a.wav"}},
             {"type": "video_url", "video_url": {"url": "file:///v.mp4"}, "fps": 2, "max_pixels": 50176},
             {"type": "audio", "audio": "a.wav", "audio_start": 0.5, "audio_end": 2.0},
             {"type": "image", "image": "x.png"}, {"type": "video", "video": ["f1.jpg", "f2.jpg"]}]
    history = [{"role": "system", "content": "You are Qwen."}, {"role": "user", "content": parts},
               {"role": "assistant", "audio": {"id": "audio_abc"}}, {"role": "user", "content": "Again."}]
    body = {"messages": history, "stop": ["a", "b"], "use_audio_in_video": True}
    req = ChatCompletionRequest.model_validate(body)
    assert [p.type for p in req.messages[1].content] == ["text", "image_url", "input_audio", "audio_url",
                                                          "video_url", "audio", "image", "video"]
    assert req.messages[0].content[0].text == "You are Qwen." and req.messages[2].audio.id == "audio_abc"
    assert req.messages[1].content[4].fps == 2 and req.stop == ["a", "b"]
    assert post({"messages": history}).status_code == 200


def test_openai_sdk_sees_the_error_fields():
    client = openai.OpenAI(api_key="k", base_url="http://testserver/v1", http_client=CLIENT, max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="qwen3-omni", messages=USER, temperature=-1)
    assert err.value.status_code == 400 and err.value.param == "temperature"
    assert err.value.type == "invalid_request_error"
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-4o", messages=USER)
    assert err.value.code == "model_not_found" and err.value.param == "model"


def test_api_key_unknown_route_and_internal_error():
    client = TestClient(make_app(api_key="sekret"), raise_server_exceptions=False)
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = client.post("/v1/chat/completions", json={"messages": USER}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    ok = {"Authorization": "Bearer sekret"}
    assert client.post("/v1/chat/completions", json={"messages": USER}, headers=ok).status_code == 200
    assert client.get("/health").status_code == 200  # not under /v1
    r = client.get("/v1/nope", headers=ok)
    assert r.status_code == 404 and r.json()["error"] == {
        "message": "Invalid URL (GET /v1/nope)", "type": "invalid_request_error", "param": None,
        "code": "unknown_url"}
    r = client.get("/v1/boom", headers=ok)
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    assert "secret" not in r.text and "Traceback" not in r.text
    headers = {**ok, "content-type": "application/json"}
    r = client.post("/v1/chat/completions", content=b"{not json", headers=headers)
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "We could not parse the JSON body of your request."
