"""GET / in a real browser: Debian's headless Chromium (driven by Playwright) opens the page on the keyed tiny
server, its fake microphone plays an espeak-ng question, server VAD ends the turn, and the page plays the
answer. Skips without Chromium (`apt-get install chromium`) or Playwright (the `test` extra)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from fastapi import FastAPI, WebSocket
from fastapi.testclient import TestClient

from omnistage.server.errors import install_api_key
from omnistage.server.page import install_page
from omnistage.server.page.subprotocol import KEY_PREFIX, REALTIME
from serve_process import KEY, MODEL, samples

pytest_plugins = ["serve_fixtures"]
CHROMIUM = shutil.which("chromium")
CLIP = Path(__file__).parent / "data" / "question_16k.wav"  # 0.5 s silence, 1.7 s speech, 1.5 s silence
FRAMES = 4


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's Chromium (apt-get install chromium)")
def test_page_talks_to_the_model(servers, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api", reason="needs Playwright (the test extra)")
    keyed = servers[1]
    args = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--use-fake-ui-for-media-stream",
            "--use-fake-device-for-media-stream", f"--use-file-for-fake-audio-capture={CLIP}%noloop",
            "--autoplay-policy=no-user-gesture-required"]
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=args)
        try:
            page = browser.new_page()
            page.goto(keyed.url + "/")
            sync_api.expect(page.locator("#status")).to_have_text("Enter the API key, then press Start.")
            page.fill("#key", KEY)
            page.evaluate(f"window.omni.session = {{max_output_tokens: {FRAMES}, max_audio_frames: {FRAMES}}}")
            page.click("#start")
            page.wait_for_function("(window.omni.events['response.done'] || 0) >= 1", timeout=45_000)
            page.wait_for_function("window.omni.played === window.omni.samples", timeout=5_000)
            omni = page.evaluate("window.omni")
            page.screenshot(path=tmp_path / "page.png")
            assert page.text_content("#model") == MODEL
            assert page.is_visible("#random")  # the tiny checkpoint's weights are random
            assert page.text_content("#start") == "Stop"
            texts = page.locator("#log li").all_text_contents()
        finally:
            browser.close()
    assert omni["errors"] == []
    events = omni["events"]
    for name in ("session.created", "session.updated", "input_audio_buffer.speech_started",
                 "input_audio_buffer.speech_stopped", "input_audio_buffer.committed", "response.created"):
        assert events.get(name, 0) >= 1, (name, events)
    assert events["response.done"] == 1
    assert omni["samples"] == samples(FRAMES)
    assert events["response.output_audio.delta"] == omni["deltas"] >= 1
    assert texts[0].startswith("You: (") and texts[0].endswith(" s of speech)")
    assert texts[1], texts  # the answer's transcript


def test_subprotocol_key_becomes_the_authorization_header():
    app = FastAPI()
    install_api_key(app, KEY)
    install_page(app)

    @app.websocket("/v1/realtime")
    async def realtime(ws: WebSocket) -> None:
        await ws.accept()
        await ws.send_json({"authorization": ws.headers.get("authorization")})
        await ws.close()

    client, bearer = TestClient(app), {"authorization": f"Bearer {KEY}"}
    with client.websocket_connect("/v1/realtime", subprotocols=[REALTIME, KEY_PREFIX + KEY]) as ws:
        assert (ws.accepted_subprotocol, ws.receive_json()) == ("realtime", bearer)
    with client.websocket_connect("/v1/realtime", subprotocols=[REALTIME, KEY_PREFIX + "wrong"],
                                  headers=dict(bearer)) as ws:  # the header wins
        assert (ws.accepted_subprotocol, ws.receive_json()) == ("realtime", bearer)
    with client.websocket_connect("/v1/realtime", headers=dict(bearer)) as ws:
        assert (ws.accepted_subprotocol, ws.receive_json()) == (None, bearer)
    page = client.get("/")  # no key needed
    assert page.status_code == 200 and page.headers["content-type"] == "text/html; charset=utf-8"
    assert "/v1/realtime" in page.text and len(page.content) < 12_000
