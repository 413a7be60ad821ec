"""The server through the official `openai` client (and the README's snippets): text, text + audio whole and
streamed, speech. Audio: 1920 samples per codec frame, minus 555 once per request (code2wav's causal trim)."""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np

from omnistage.config import DEPLOY_DIR
from omnistage.config_loader import load_deploy_config
from omnistage.server.speech import SPEECH_SYSTEM_PROMPT
from graph_helpers import packet_sizes
from serve_process import MODEL, USER, samples, wav_samples

pytest_plugins = ["serve_fixtures"]
FRAMES = 12  # audio packets of 2, 2, 4, 4 frames (the deploy config's growing schedule)
CONNECTOR = load_deploy_config(DEPLOY_DIR / "qwen3_omni_moe.yaml", "cpu").connector
SHORT = {"max_tokens": 6, "extra_body": {"max_audio_frames": FRAMES}}
README = Path(__file__).parents[1] / "README.md"


def test_startup_log_and_model_list(server, client):
    log = server.log.read_text()
    assert "weights are RANDOM" in log
    deploy = json.loads(re.search(r"deploy config: (\{.*\})", log).group(1))
    assert deploy["stages"]["thinker"]["max_batch_size"] == 8  # --stage-overrides
    assert deploy["stages"]["talker"]["dtype"] == "float32" and not deploy["stages"]["talker"]["cuda_graph"]
    (model,) = httpx.get(server.url + "/v1/models").json()["data"]
    assert model["id"] == MODEL and model["random_weights"] is True
    assert model["voices"] == ["aiden", "chelsie", "ethan"]
    assert client.models.retrieve(MODEL).id == MODEL and client.models.list().data[0].id == MODEL
    assert httpx.get(server.url + "/v1/models/org/other").json()["error"]["code"] == "model_not_found"
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_text_only(client):
    c = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=5, temperature=0)
    m = c.choices[0].message
    assert isinstance(m.content, str) and m.content and m.audio is None
    assert c.usage.completion_tokens == 5 and c.choices[0].finish_reason == "length"
    assert c.usage.completion_tokens_details.audio_tokens == 0


def test_text_and_audio_whole(client):
    c = client.chat.completions.create(model=MODEL, messages=USER, modalities=["text", "audio"],
                                       audio={"voice": "Chelsie", "format": "wav"}, seed=3, **SHORT)
    m, usage = c.choices[0].message, c.usage
    frames = usage.completion_tokens_details.audio_tokens
    assert 0 < frames <= FRAMES and usage.completion_tokens == 6 + frames
    assert m.audio.transcript == m.content and m.audio.id.startswith("audio_") and m.audio.expires_at > 0
    assert wav_samples(base64.b64decode(m.audio.data)).size == samples(frames)


def stream_chat(client, **kw) -> tuple[str, bytes, list[dict], object]:
    chunks = list(client.chat.completions.create(model=MODEL, messages=USER, stream=True,
                                                 stream_options={"include_usage": True}, **kw))
    deltas = [c.choices[0].delta.model_dump() for c in chunks if c.choices]
    audio = [d["audio"] for d in deltas if d.get("audio") and d["audio"].get("data")]
    pcm = b"".join(base64.b64decode(a["data"]) for a in audio)
    return "".join(d.get("content") or "" for d in deltas), pcm, audio, chunks[-1].usage


def test_stream_equals_whole_with_same_seed(client):
    kw = dict(modalities=["text", "audio"], temperature=0.8, seed=11, **SHORT)
    whole = client.chat.completions.create(model=MODEL, messages=USER,
                                           audio={"voice": "aiden", "format": "wav"}, **kw)
    text, pcm, audio, usage = stream_chat(client, audio={"voice": "aiden", "format": "pcm16"}, **kw)
    frames = usage.completion_tokens_details.audio_tokens
    assert text == whole.choices[0].message.content
    assert frames == whole.usage.completion_tokens_details.audio_tokens
    streamed = np.frombuffer(pcm, "<i2")
    assert streamed.size == samples(frames)
    assert np.array_equal(streamed, wav_samples(base64.b64decode(whole.choices[0].message.audio.data)))
    packets = packet_sizes(frames, CONNECTOR.initial_codec_chunk_frames, CONNECTOR.codec_chunk_frames,
                           CONNECTOR.codec_chunk_growth)
    sizes = [len(base64.b64decode(a["data"])) // 2 for a in audio]  # as produced, the id on the first only
    assert sizes == [samples(n) if i == 0 else n * 1920 for i, n in enumerate(packets)]
    assert audio[0]["id"].startswith("audio_") and all(a.get("id") is None for a in audio[1:])


def test_concurrent_requests_keep_their_voices(client):
    def run(voice: str) -> tuple[str, np.ndarray]:
        c = client.chat.completions.create(model=MODEL, messages=USER, modalities=["text", "audio"],
                                           audio={"voice": voice, "format": "pcm16"}, temperature=0,
                                           max_tokens=6, extra_body={"max_audio_frames": FRAMES,
                                                                     "talker": {"temperature": 0}})
        m = c.choices[0].message
        return m.content, np.frombuffer(base64.b64decode(m.audio.data), "<i2")

    voices = ["aiden", "chelsie", "ethan"]
    alone = [run(v) for v in voices]
    with ThreadPoolExecutor(6) as pool:
        together = list(pool.map(run, voices * 2))
    assert len({pcm.tobytes() for _, pcm in alone}) == 3  # the voices sound different
    for (text, pcm), (text2, pcm2) in zip(alone * 2, together):
        assert text2 == text and pcm2.shape == pcm.shape
        assert np.abs(pcm2.astype(np.int32) - pcm).max() <= 1  # batched float sums: at most 1 LSB apart


def speech_as_chat(client, voice: str, seed: int) -> tuple[np.ndarray, int]:
    """What /v1/audio/speech documents it runs: the read-aloud turn through chat, greedy thinker."""
    messages = [{"role": "system", "content": SPEECH_SYSTEM_PROMPT},
                {"role": "user", "content": "Hello there."}]
    c = client.chat.completions.create(model=MODEL, messages=messages, modalities=["text", "audio"],
                                       audio={"voice": voice, "format": "pcm16"}, temperature=0, seed=seed,
                                       **SHORT)
    pcm = np.frombuffer(base64.b64decode(c.choices[0].message.audio.data), "<i2")
    return pcm, c.usage.completion_tokens_details.audio_tokens


def test_speech_whole_and_streamed(client, server):
    expected, frames = speech_as_chat(client, "chelsie", 5)
    assert expected.size == samples(frames)
    body = dict(model=MODEL, input="Hello there.", voice="Chelsie",
                extra_body={"max_tokens": 6, "max_audio_frames": FRAMES, "seed": 5})
    wav = client.audio.speech.create(response_format="wav", **body).content
    assert np.array_equal(wav_samples(wav), expected)
    assert client.audio.speech.create(response_format="pcm", **body).content == expected.tobytes()
    with client.audio.speech.with_streaming_response.create(response_format="pcm", stream_format="audio",
                                                           **body) as r:
        assert r.headers["content-type"] == "audio/pcm"
        assert b"".join(r.iter_bytes()) == expected.tobytes()
    stream = {**body.pop("extra_body"), **body, "response_format": "wav", "stream": True}
    with httpx.stream("POST", server.url + "/v1/audio/speech", json=stream, timeout=60) as r:
        data = r.read()
    assert data[:4] == b"RIFF" and data[4:8] == b"\xff\xff\xff\xff" and data[44:] == expected.tobytes()


def test_local_media_under_allowed_path(client, media):
    tone = media / "tone.wav"
    inline = {"type": "input_audio", "input_audio": {"data": base64.b64encode(tone.read_bytes()).decode(),
                                                     "format": "wav"}}
    local = {"type": "audio_url", "audio_url": {"url": f"file://{tone}"}}
    out = [client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                          max_tokens=3, temperature=0) for content in ([inline], [local], "")]
    assert out[0].usage.prompt_tokens == out[1].usage.prompt_tokens > out[2].usage.prompt_tokens + 25  # 2 s
    assert out[0].choices[0].message.content == out[1].choices[0].message.content


def test_readme_quickstart_runs_as_written(server, tmp_path):
    section = README.read_text().split("## Serving", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```(bash|python)\n(.*?)```", section, re.S)
    runnable = [(lang, code.replace("8091", str(server.port))) for lang, code in blocks
                if "localhost:8091" in code]
    assert {lang for lang, _ in runnable} == {"bash", "python"}
    if shutil.which("curl") is None:
        runnable = [(lang, code) for lang, code in runnable if lang == "python"]
    for lang, code in runnable:
        cmd = ["bash", "-euo", "pipefail", "-c", code] if lang == "bash" else [sys.executable, "-c", code]
        out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
    assert wav_samples((tmp_path / "reply.wav").read_bytes()).size % 1920 == 1920 - 555
