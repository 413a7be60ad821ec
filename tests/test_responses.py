from __future__ import annotations

import base64
import json

from openai.types.chat import ChatCompletion, ChatCompletionChunk

from omnistage.outputs import Usage
from omnistage.server.responses import SSE_DONE, ResponseHead, audio_delta, model_list, sse


def test_completion_with_audio_parses_as_openai_types():
    head = ResponseHead(model="qwen3-omni")
    body = head.completion("Hi there.", "stop", Usage(prompt_tokens=20, completion_tokens=4, audio_frames=25),
                           audio=b"RIFF1234")
    c = ChatCompletion.model_validate(body)
    assert c.id.startswith("chatcmpl-") and c.object == "chat.completion" and c.model == "qwen3-omni"
    m = c.choices[0].message
    assert m.content == "Hi there." and m.audio.transcript == "Hi there." and m.audio.id == head.audio_id
    assert base64.b64decode(m.audio.data) == b"RIFF1234" and m.audio.expires_at == head.created + 24 * 3600
    u = c.usage
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (20, 29, 49)
    assert (u.completion_tokens_details.audio_tokens, u.completion_tokens_details.text_tokens) == (25, 4)
    assert "audio" not in head.completion("x", "length", Usage())["choices"][0]["message"]


def test_stream_chunks_parse_as_openai_types():
    head = ResponseHead(model="m")
    events = [head.chunk({"role": "assistant", "content": ""}), head.chunk({"content": "Hi"}),
              head.chunk(audio_delta(b"\x01\x00\x02\x00", head.audio_id)),
              head.chunk(audio_delta(b"\x03\x00")),
              head.audio_done_chunk(), head.chunk({}, "stop"), head.usage_chunk(Usage(3, 2, 1))]
    text = "".join(sse(e) for e in events) + SSE_DONE
    frames = text.split("\n\n")
    assert frames[-2:] == ["data: [DONE]", ""] and len(frames) == len(events) + 2
    chunks = [ChatCompletionChunk.model_validate(json.loads(f.removeprefix("data: "))) for f in frames[:-2]]
    assert {c.id for c in chunks} == {head.id} and all(c.object == "chat.completion.chunk" for c in chunks)
    # older openai SDKs have no typed delta.audio: read the wire dicts
    audio = [json.loads(f.removeprefix("data: "))["choices"][0]["delta"]["audio"] for f in frames[2:5]]
    assert audio[0]["id"] == head.audio_id and "id" not in audio[1]
    data = base64.b64decode(audio[0]["data"]) + base64.b64decode(audio[1]["data"])
    assert data == b"\x01\x00\x02\x00\x03\x00"
    assert audio[2] == {"expires_at": head.audio_expires_at}
    assert chunks[5].choices[0].finish_reason == "stop" and chunks[6].choices == []
    assert (chunks[6].usage.completion_tokens, chunks[6].usage.total_tokens) == (3, 6)


def test_model_list():
    assert model_list(["qwen3-omni"], 7) == {"object": "list", "data": [
        {"id": "qwen3-omni", "object": "model", "created": 7, "owned_by": "omnistage"}]}
