"""A thinker-only checkpoint (-Thinking / -Captioner: enable_audio_output false, no talker or code2wav
tensors) serves text through `omnistage serve`'s app; every ask for audio is a 400 that says why."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from omnistage.models.qwen3_omni.make_tiny import tiny_checkpoint
from omnistage.models.qwen3_omni.checkpoint_io import checkpoint_files
from omnistage.outputs import NO_AUDIO_OUTPUT
from omnistage.server.launch import build
from omnistage.server.serve_args import add_serve_args


@pytest.fixture(scope="module")
def http():
    import argparse

    folder = tiny_checkpoint("tiny", 0, thinker_only=True)
    args = add_serve_args(argparse.ArgumentParser()).parse_args([str(folder), "--device", "cpu"])
    app, engine = build(args)
    try:
        yield TestClient(app)
    finally:
        engine.shutdown()


def test_folder_has_no_talker_or_code2wav():
    from safetensors import safe_open

    folder = tiny_checkpoint("tiny", 0, thinker_only=True)
    config = json.loads((folder / "config.json").read_text())
    assert config["enable_audio_output"] is False and "talker_config" not in config
    names = [k for f in checkpoint_files(folder) for k in safe_open(str(f), "pt").keys()]
    assert names and all(n.startswith("thinker.") for n in names)


def test_text_served_and_models_say_no_audio(http):
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] == 4 and "audio" not in body["choices"][0]["message"]
    model = http.get("/v1/models").json()["data"][0]
    assert (model["voices"], model["audio_output"]) == ([], False)


HI = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("route, body, param", [
    ("/v1/chat/completions", {"messages": HI, "modalities": ["text", "audio"]}, "modalities"),
    ("/v1/chat/completions", {"messages": HI, "modalities": ["text", "audio"],
                              "audio": {"voice": "Ethan", "format": "wav"}}, "modalities"),
    ("/v1/audio/speech", {"input": "Hello", "voice": "Ethan"}, None),
])
def test_audio_asks_are_400s(http, route, body, param):
    r = http.post(route, json=body)
    assert r.status_code == 400
    assert r.json()["error"] == {"message": NO_AUDIO_OUTPUT, "type": "invalid_request_error", "param": param,
                                 "code": None}


def test_realtime_session_is_text_only(http):
    with http.websocket_connect("/v1/realtime") as ws:
        created = ws.receive_json()
        assert created["type"] == "session.created" and created["session"]["output_modalities"] == ["text"]
        ws.send_json({"type": "session.update", "event_id": "e1",
                      "session": {"output_modalities": ["audio"]}})
        error = ws.receive_json()["error"]
        assert (error["message"], error["param"], error["event_id"]) == (NO_AUDIO_OUTPUT,
                                                                         "session.output_modalities", "e1")
        ws.send_json({"type": "session.update", "session": {"audio": {"input": {"turn_detection": None}}}})
        assert ws.receive_json()["type"] == "session.updated"
        item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]}
        ws.send_json({"type": "conversation.item.create", "item": item})
        ws.send_json({"type": "response.create", "response": {"max_output_tokens": 3}})
        events = [ws.receive_json()]
        while events[-1]["type"] != "response.done":
            events.append(ws.receive_json())
        assert sum(e["type"] == "response.output_text.delta" for e in events) == 3
        assert events[-1]["response"]["usage"]["output_tokens"] == 3
