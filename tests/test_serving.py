"""Engine refusals and engine failures through the app (in-process, fake engines)."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from omnistage.config import DEPLOY_DIR
from omnistage.config_loader import load_deploy_config
from omnistage.media import MediaError
from omnistage.outputs import OutputDelta
from omnistage.server.app import create_app

USER = [{"role": "user", "content": "Hi"}]


class Engine:
    """Refuses with `refuse` before the first item, or fails the request after one text piece."""

    def __init__(self, refuse: Exception | None = None) -> None:
        self.refuse, self.aborted = refuse, []

    async def generate(self, request_id, messages, sampling, talker_sampling, voice, use_audio_in_video, session=None):
        if self.refuse is not None:
            raise self.refuse
        yield OutputDelta(request_id, text="Hel")
        yield OutputDelta(request_id, finished=True, finish_reason="error")

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def http(engine: Engine) -> TestClient:
    deploy = load_deploy_config(DEPLOY_DIR / "qwen3_omni_moe.yaml", "cpu")
    return TestClient(create_app(engine, "m", deploy, ["ethan"]), raise_server_exceptions=False)


@pytest.mark.parametrize("error", [MediaError("cannot decode audio: junk"), ValueError("unknown voice 'x'")])
@pytest.mark.parametrize("url, body", [("/v1/chat/completions", {"messages": USER}),
                                       ("/v1/chat/completions", {"messages": USER, "stream": True}),
                                       ("/v1/audio/speech", {"input": "Hi", "stream": True})])
def test_engine_refusal_is_a_400(error, url, body):
    r = http(Engine(error)).post(url, json=body)
    assert r.status_code == 400 and r.json()["error"]["message"] == str(error)


def test_engine_failure_is_a_500_or_an_error_event():
    client = http(Engine())
    r = client.post("/v1/chat/completions", json={"messages": USER})
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    with client.stream("POST", "/v1/chat/completions", json={"messages": USER, "stream": True}) as r:
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line]
    assert r.status_code == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["type"] == "server_error"
    assert all("finish_reason" not in e or '"finish_reason":null' in e for e in events[:-2])
