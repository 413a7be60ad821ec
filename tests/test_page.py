"""GET / in a real browser: Debian's headless Chromium (driven by Playwright) opens the page on the keyed tiny
server; a text file is refused as an attachment and an image is attached; its fake microphone says a question,
server VAD ends the turn and the page plays the answer (the image in the turn's prompt); the microphone speaks
again while the answer plays: the page stops playback and truncates the answer to what was heard (when it had
played all it got, the server's cancel alone cuts it), and the second answer plays. Then push-to-talk: the
space bar held and let go commits the (silent) input and asks for a third answer. Every user turn gets its
transcript line; the server's timings show beside the page's. Skips without Chromium (`apt-get install
chromium`) or Playwright."""

from __future__ import annotations

import base64
import json
import re
import shutil
from importlib.util import find_spec
from pathlib import Path

import pytest
from fastapi import FastAPI, WebSocket
from fastapi.testclient import TestClient
from PIL import Image
from serve_process import KEY, MODEL, samples

from omnistage.server.errors import install_api_key, install_error_handlers
from omnistage.server.page import install_page
from omnistage.server.page.subprotocol import KEY_PREFIX, REALTIME

pytest_plugins = ["serve_fixtures"]
CHROMIUM = shutil.which("chromium")
# espeak-ng, 16 kHz: 0.5 s silence, "Hello, how are you today?" (1.7 s), 3 s silence, "Wait, stop." (1.2 s)
CLIP = Path(__file__).parent / "data" / "two_turns_16k.wav"
FRAMES = 40  # 3.2 s of audio: still playing when the second turn starts 2.7 s after the first ended
SPEECH = {"session.created": 1, "session.updated": 2, "input_audio_buffer.speech_started": 2,
          "input_audio_buffer.speech_stopped": 2, "input_audio_buffer.cleared": 1,
          "input_audio_buffer.committed": 3, "response.created": 3, "response.done": 3,
          "conversation.item.truncated": 1, "conversation.item.input_audio_transcription.completed": 3}
TRANSCRIPT = "(omni.events['conversation.item.input_audio_transcription.completed'] || 0) === 3"


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's Chromium (apt-get install chromium)")
@pytest.mark.skipif(find_spec("playwright") is None, reason="needs Playwright (the test extra)")
def test_page_talks_to_the_model(keyed_server, tmp_path):
    from playwright import sync_api
    args = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
            f"--use-file-for-fake-audio-capture={CLIP}%noloop", "--autoplay-policy=no-user-gesture-required"]
    received: dict[str, int] = {}  # samples of each answer on the wire, as the browser got them
    images: list[str] = []  # the input_image items the page sent
    Image.new("RGB", (32, 32), (200, 40, 40)).save(tmp_path / "red.png")
    (tmp_path / "notes.txt").write_text("not an image")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=args)
        try:
            page = browser.new_page()
            page.on("websocket", lambda ws: (ws.on("framereceived", lambda f: count_audio(f, received)),
                                             ws.on("framesent", lambda f: image_sent(f, images))))
            page.goto(keyed_server.url + "/")
            sync_api.expect(page.locator("#status")).to_have_text("Enter the API key, then press Start.")
            start = page.locator("#start").bounding_box()
            page.fill("#key", KEY)
            page.press("#key", "Tab")  # the model loads (name, voices, random-weights note): Start stays put
            sync_api.expect(page.locator("#model")).to_have_text(MODEL)
            sync_api.expect(page.locator("#random")).to_be_visible()
            assert page.locator("#start").bounding_box() == start
            page.set_input_files("#file", tmp_path / "notes.txt")
            sync_api.expect(page.locator("#attach-note")).to_contain_text("notes.txt is not an image")
            page.set_input_files("#file", tmp_path / "red.png")  # sent at Start
            sync_api.expect(page.locator("#chip")).to_contain_text("red.png")
            page.evaluate(f"omni.session = {{max_output_tokens: 4, max_audio_frames: {FRAMES}, seed: 0}}")
            page.click("#start")
            wait_for(page, "(omni.events['response.done'] || 0) >= 2", 40_000)
            vad_turn = page.evaluate("omni.lastTurn")
            chip_hidden = page.is_hidden("#chip")  # the first turn took the image
            page.wait_for_function("omni.played + omni.dropped === omni.samples", timeout=10_000)  # all heard
            page.check("#ptt")  # push-to-talk: no server VAD; the space bar held 0.6 s, then let go
            page.wait_for_function("omni.events['session.updated'] === 2")
            page.keyboard.down("Space")
            page.wait_for_timeout(600)
            page.keyboard.up("Space")
            wait_for(page, "(omni.events['response.done'] || 0) >= 3", 20_000)
            page.wait_for_function("omni.played + omni.dropped === omni.samples", timeout=10_000)
            page.wait_for_function(TRANSCRIPT, timeout=10_000)
            omni = page.evaluate("omni")
            page.screenshot(path=tmp_path / "page.png")
            page.set_viewport_size({"width": 390, "height": 844})
            page.screenshot(path=tmp_path / "page-phone.png")
            assert page.text_content("#model") == MODEL
            assert page.is_visible("#random")  # the tiny checkpoint's weights are random
            assert page.text_content("#start") == "Stop"
            lines = page.eval_on_selector_all(
                "#log li", "els => els.map(e => [e.className, e.textContent, e.dataset.item])")
            cut = page.locator("#log li.cut").all_text_contents()
            page_text, server_text = page.text_content("#turn"), page.text_content("#server")
        finally:
            browser.close()
    assert omni["errors"] == []
    # NOTE: on a slow machine the page may have played all it got of the first answer when the second turn cut
    # it (the server cancelled the rest): nothing dropped, nothing for the page to truncate
    page_cut = omni["dropped"] > 0
    expected = {**SPEECH, "conversation.item.truncated": 1 if page_cut else None}
    assert {name: omni["events"].get(name) for name in SPEECH} == expected, omni
    assert omni["answers"] == received and omni["samples"] == sum(received.values())
    first, second, third = received.values()
    # the later answers whole (code2wav: N frames make N * 1920 - 555 samples; EOS may come before FRAMES)
    assert all((n + 555) % 1920 == 0 and 0 < n <= samples(FRAMES) for n in (second, third))
    # the first one cut while playing (by the server too, if it was not all out yet), or by the server alone
    if page_cut:
        assert omni["dropped"] <= first <= samples(FRAMES) and 0 < omni["heard"] < first * 1000 // 24000
    else:  # cut by the server before it was all sent
        assert 0 < first < samples(FRAMES)
    assert omni["events"]["response.output_audio.delta"] == omni["deltas"]
    # the image went out as an item before the first turn, and the server added it
    assert len(images) == 1 and omni["images"] == images and chip_hidden
    assert lines[0] == ["user image", "(image: red.png)", images[0]]
    texts = [text for _, text, _ in lines[1:]]
    assert len(texts) == 6 and all(cls == "user heard" for cls, _, _ in lines[1::2]), lines
    # the user's lines: the server's transcript of the turn (random weights: any text), then its length
    assert sorted(omni["transcripts"]) == sorted(item for _, _, item in lines[1::2])
    for _, text, item in lines[1::2]:
        said = omni["transcripts"][item].strip()
        assert re.fullmatch(re.escape(f"{said} " if said else "") + r"\(\d\.\d s of speech\)", text), text
    assert all(texts[1::2]) and cut == ([texts[1]] if page_cut else [])  # answers' transcripts; the first cut
    # the client's timings of a turn: VAD decision (or the key let go) -> first audio; the answer's RTF
    for timed, n in ((vad_turn, second), (omni["lastTurn"], third)):
        assert timed["first_audio_ms"] > 0 and timed["rtf"] > 0 and timed["audio_s"] == n / 24000, timed
    assert page_text.startswith("Last turn: release → first audio ") and " RTF " in page_text
    # the server's own: speech_stopped (VAD turns) and response.created -> first audio, RTF
    vad, ptt = omni["server"][vad_turn["response_id"]], omni["server"][omni["lastTurn"]["response_id"]]
    assert vad["vad_to_first_audio_ms"] >= vad["first_audio_ms"] > 0 and vad["rtf"] > 0, vad
    assert ptt["vad_to_first_audio_ms"] is None and ptt["first_audio_ms"] > 0 and ptt["rtf"] > 0, ptt
    assert server_text.startswith("Server, last turn: response.created → first audio ")
    assert " RTF " in server_text


def wait_for(page, condition: str, timeout_ms: int) -> None:
    """`page.wait_for_function`, failing with the page's events so far (what the turns got to)."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    try:
        page.wait_for_function(condition, timeout=timeout_ms)
    except PlaywrightTimeout:
        raise AssertionError(f"{condition} not within {timeout_ms} ms; status: "
                             f"{page.locator('#status').text_content()!r}, events: "
                             f"{page.evaluate('JSON.stringify(omni.events)')}, errors: "
                             f"{page.evaluate('JSON.stringify(omni.errors)')}") from None


def count_audio(payload: str | bytes, received: dict[str, int]) -> None:
    event = json.loads(payload)
    if event["type"] == "response.output_audio.delta":
        item = event["item_id"]
        received[item] = received.get(item, 0) + len(base64.b64decode(event["delta"])) // 2


def image_sent(payload: str | bytes, images: list[str]) -> None:
    event = json.loads(payload)
    if event["type"] == "conversation.item.create" and event["item"]["content"][0]["type"] == "input_image":
        assert event["item"]["content"][0]["image_url"].startswith("data:image/png;base64,")
        images.append(event["item"]["id"])


def test_subprotocol_key_becomes_the_authorization_header():
    app = FastAPI()
    install_error_handlers(app)
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
    assert "/v1/realtime" not in page.text and len(page.content) < 4_000
    for name in ("app.js", "turns.js", "attach.js", "worklets.js"):  # its scripts
        script = client.get(f"/page/{name}")
        assert (script.status_code, script.headers["content-type"]) == (200, "text/javascript; charset=utf-8")
        assert len(script.content) < 12_000
    assert "/v1/realtime" in client.get("/page/app.js").text
    missing = client.get("/page/subprotocol.py")
    error = missing.json()["error"]
    assert (missing.status_code, error["message"], error["code"]) == (
        404, "Invalid URL (GET /page/subprotocol.py)", "unknown_url")
