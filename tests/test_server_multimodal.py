"""Media parts through the real server with the openai client: fetched, local and inline audio give the
same prompt; images, videos and a video's audio track answer with text and audio; every media error is a
400 in OpenAI's shape whose message and param name the item."""

from __future__ import annotations

import base64
import functools
import io
import threading
from pathlib import Path
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import httpx
import openai
import pytest
import soundfile as sf
from media_samples import data_url, mp4_bytes, png_bytes
from serve_process import KEY, MODEL

from omnistage.media import to_conversation

pytest_plugins = ["serve_fixtures"]


@pytest.fixture(scope="module")
def media_url(media):
    """An http server on loopback over the media folder (tone.wav)."""
    handler = functools.partial(SimpleHTTPRequestHandler, directory=str(media))
    handler.log_message = lambda *args: None
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def ask(client: openai.OpenAI, *parts: dict, **extra):
    return client.chat.completions.create(model=MODEL, max_tokens=3, temperature=0, extra_body=extra or None,
                                          messages=[{"role": "user", "content": [*parts, {"type": "text",
                                                                                          "text": "What?"}]}])


def test_audio_from_url_path_and_inline_agree(client, media, media_url):
    tone = media / "tone.wav"
    inline = {"type": "input_audio", "input_audio": {"data": base64.b64encode(tone.read_bytes()).decode(),
                                                     "format": "wav"}}
    fetched = {"type": "audio_url", "audio_url": {"url": media_url + "/tone.wav"}}
    native = {"type": "audio", "audio": "tone.wav", "audio_start": 0.5, "audio_end": 1.5}  # relative: the folder
    out = [ask(client, part) for part in (inline, fetched, native)]
    assert out[0].usage.prompt_tokens == out[1].usage.prompt_tokens == out[2].usage.prompt_tokens + 13  # 1 s less
    assert out[0].choices[0].message.content == out[1].choices[0].message.content


def bad(client: openai.OpenAI, *parts: dict, **extra) -> str:
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, *parts, **extra)
    error = e.value.body
    assert e.value.status_code == 400 and error["type"] == "invalid_request_error"
    assert error["message"].startswith(f"{error['param']} ") or error["param"] == "messages", error
    return error["message"]


BAD = [
    ({"type": "input_audio", "input_audio": {"data": "not base64!!", "format": "wav"}},
     "messages[0].content[0] (input_audio): invalid base64 data"),
    ({"type": "image_url", "image_url": {"url": data_url(b"\x89PNG junk", "image/png")}},
     "messages[0].content[0] (image_url): cannot decode image"),
    ({"type": "video_url", "video_url": {"url": data_url(b"\x00\x00\x00 ftypisom junk", "video/mp4")}},
     "messages[0].content[0] (video_url): cannot decode video"),
    ({"type": "video", "video": data_url(mp4_bytes(1, 10), "video/mp4")},
     "messages[0].content[0] (video): video has 1 frame(s), fewer than 2"),
    ({"type": "audio_url", "audio_url": {"url": "file:///etc/hostname"}},
     "messages[0].content[0] (audio_url): local file is outside --allowed-local-media-path"),
    ({"type": "audio", "audio": "../../etc/hostname"}, "local file is outside --allowed-local-media-path"),
    ({"type": "audio_url", "audio_url": {"url": "http://127.0.0.1:1/a.wav"}}, "cannot fetch URL (connection failed)"),
    ({"type": "image", "image": "http://no-such-host.invalid/a.png"}, "cannot resolve the URL's host"),
]


@pytest.mark.parametrize("part, needle", BAD)
def test_media_errors_are_400s_naming_the_item(client, part, needle):
    message = bad(client, part)
    assert needle in message and "/etc" not in message and "127.0.0.1" not in message, message


def test_too_many_items_and_private_urls(client, server, keyed_server, media_url):
    assert "17 media items, more than 16 per request" in bad(client, *[{"type": "audio", "audio": "x"}] * 17)
    keyed = openai.OpenAI(base_url=keyed_server.url + "/v1", api_key=KEY, max_retries=0)
    message = bad(keyed, {"type": "audio_url", "audio_url": {"url": media_url + "/tone.wav"}})
    assert "private, loopback or link-local address (allowed only with --allow-private-media-urls)" in message
    assert "local files are not allowed" in bad(keyed, {"type": "audio", "audio": "tone.wav"})
    assert httpx.get(server.url + "/health").status_code == 200


def spoken(client: openai.OpenAI, *parts: dict, **extra):
    reply = client.chat.completions.create(
        model=MODEL, max_tokens=3, temperature=0, modalities=["text", "audio"], audio={"voice": "Ethan", "format": "wav"},
        extra_body={"max_audio_frames": 3, **extra},
        messages=[{"role": "user", "content": [*parts, {"type": "text", "text": "What is it?"}]}])
    wav = base64.b64decode(reply.choices[0].message.audio.data)
    assert reply.choices[0].message.content and wav[:4] == b"RIFF" and len(wav) > 44
    return reply


def test_image_and_video_requests(client, media_url):
    text_only = spoken(client).usage.prompt_tokens
    image = spoken(client, {"type": "image_url", "image_url": {"url": data_url(png_bytes(64, 64), "image/png")}})
    clip = data_url(mp4_bytes(20, 10, audio_seconds=2.0), "video/mp4")
    video = spoken(client, {"type": "video_url", "video_url": {"url": clip}})
    both = spoken(client, {"type": "video", "video": clip}, mm_processor_kwargs={"use_audio_in_video": True})
    assert text_only < image.usage.prompt_tokens and text_only < video.usage.prompt_tokens
    track = to_conversation([{"role": "user", "content": [{"type": "video", "video": clip}]}],
                            use_audio_in_video=True).audios[0]
    buf = io.BytesIO()
    sf.write(buf, track, 16000, format="WAV", subtype="FLOAT")
    apart = spoken(client, {"type": "video", "video": clip}, {"type": "audio", "audio": data_url(buf.getvalue(), "a")})
    assert both.usage.prompt_tokens == apart.usage.prompt_tokens > video.usage.prompt_tokens + 20  # the track's rows
    message = bad(client, {"type": "video", "video": data_url(mp4_bytes(), "video/mp4")}, use_audio_in_video=True)
    assert "messages[0].content[0] (video): no audio track (use_audio_in_video needs one)" in message


def test_real_repo_layout_serves_image_and_audio_in_text_and_audio_out(client, server, media):
    """The server's tiny checkpoint is laid out as the released repo (vocab.json + merges.txt, the template in
    chat_template.json, one preprocessor_config.json): an image and an audio in, text and speech out."""
    root = Path(httpx.get(server.url + "/v1/models").json()["data"][0]["root"])
    assert sorted(f.name for f in root.iterdir() if f.suffix != ".safetensors") == [
        "chat_template.json", "config.json", "generation_config.json", "merges.txt",
        "model.safetensors.index.json", "preprocessor_config.json", "tokenizer_config.json", "vocab.json"]
    tone = base64.b64encode((media / "tone.wav").read_bytes()).decode()
    text_only = spoken(client).usage.prompt_tokens
    image = {"type": "image_url", "image_url": {"url": data_url(png_bytes(64, 64), "image/png")}}
    both = spoken(client, image, {"type": "input_audio", "input_audio": {"data": tone, "format": "wav"}})
    # 64 x 64 px: 2 x 2 merged tokens; 2 s at 16 kHz: 26; each with its start and end token
    assert both.usage.prompt_tokens == text_only + (4 + 2) + (26 + 2)
