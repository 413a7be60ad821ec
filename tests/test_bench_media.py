"""`omnistage bench`'s media workloads: the shipped clips decode with the server's decoder to their sample
counts, the photos load at their sizes, the videos decode with frames and an audio track, every request's
bytes differ while its media stay the same; the playback-stall metric on hand-made chunk timings; and each
workload against the tiny server into one results file."""

from __future__ import annotations

import argparse
import base64
import io
import json

import numpy as np
import pytest
import soundfile as sf

from omnistage.bench.cli import add_bench_args, run_bench
from omnistage.bench.media import DEFAULT_PHOTOS, PHOTOS, SPEECH_DIR, SPOKEN, photo, spoken_clip, varied
from omnistage.bench.media_workload import QUESTIONS, SYSTEM_PROMPT, MediaOptions, build_media_requests
from omnistage.bench.metrics import RequestResult, playback_stalls, summarize
from omnistage.bench.report import RESULTS, TABLE
from omnistage.bench.workload import build_requests, token_counter
from omnistage.media import MediaPolicy
from omnistage.media.decode import decode_audio_bytes, decode_image_bytes
from omnistage.media.video import decode_video_bytes

pytest_plugins = ["serve_fixtures"]
SIZES = {"astronaut": (512, 512), "coffee": (600, 400), "chelsea": (451, 300), "rocket": (640, 427),
         "hd": (1280, 720), "phone": (4032, 3024)}


def _media_bytes(part: dict) -> bytes:
    if part["type"] == "input_audio":
        return base64.b64decode(part["input_audio"]["data"])
    url = part[part["type"]]["url"]
    return base64.b64decode(url.split(",", 1)[1])


def test_spoken_questions_decode_to_their_lengths_at_the_read_aloud_output_lengths():
    counter = token_counter()
    reqs = build_media_requests("spoken-question", 14, 3, counter)
    frames = [sf.info(SPEECH_DIR / "spoken" / f"{name}.flac").frames for name in SPOKEN]
    assert [sf.info(SPEECH_DIR / "spoken" / f"{name}.flac").samplerate for name in SPOKEN] == [16000] * 12
    assert 2.0 <= min(frames) / 16000 < 2.5 and 14.0 < max(frames) / 16000 <= 15.0
    audio = []
    for r in reqs:
        system, user = r.messages
        assert system == {"role": "system", "content": SYSTEM_PROMPT}
        part, text = user["content"]
        assert part["type"] == "input_audio" and part["input_audio"]["format"] == "flac"
        assert text == {"type": "text", "text": "Answer the question you hear."}
        audio.append(_media_bytes(part))
        assert decode_audio_bytes(audio[-1]).size == frames[r.index % 12]  # the server's decoder, 16 kHz
        assert r.prompt_tokens == counter.count(SYSTEM_PROMPT) + counter.count(text["text"])
    assert len(set(audio)) == 14  # each request's audio differs (what the server decodes), by a few LSB
    a, b = decode_audio_bytes(audio[12]), decode_audio_bytes(audio[0])
    assert not np.array_equal(a, b) and np.abs(a - b).max() < 2e-3
    read_aloud = build_requests(160, 14, 3, counter)
    assert [(r.sentence, r.text_tokens, r.audio_frames, r.seed) for r in reqs] == [
        (r.sentence, r.text_tokens, r.audio_frames, r.seed) for r in read_aloud]
    options = MediaOptions(("question_5s",), repeat_media=True)
    same = build_media_requests("spoken-question", 2, 0, counter, options)
    wav = (SPEECH_DIR / "question_5s.wav").read_bytes()
    assert [_media_bytes(r.messages[1]["content"][0]) for r in same] == [wav, wav]
    assert same[0].messages[1]["content"][0]["input_audio"]["format"] == "wav"
    assert decode_audio_bytes(varied(spoken_clip("question_5s"), 9)).size == sf.info(io.BytesIO(wav)).frames
    with pytest.raises(ValueError, match="unknown clip 'q13': one of q01, q02"):
        spoken_clip("q13")


def test_photos_load_at_their_sizes():
    reqs = build_media_requests("visual-question", 7, 0, token_counter(), MediaOptions(PHOTOS))
    for r, name in zip(reqs, PHOTOS + PHOTOS[:1]):
        part, text = r.messages[1]["content"]
        assert part["type"] == "image_url" and part["image_url"]["url"].startswith("data:image/jpeg;base64,")
        assert text["text"] == QUESTIONS["visual-question"][r.index % 3]
        data = _media_bytes(part)
        assert data != photo(name).data and decode_image_bytes(data, 10**8).size == SIZES[name], name
    first, again = (np.asarray(decode_image_bytes(_media_bytes(reqs[i].messages[1]["content"][0]), 10**8))
                    for i in (0, 6))  # astronaut twice: what the server decodes differs (the corner block)
    assert first.shape == again.shape and not np.array_equal(first[:8, :8], again[:8, :8])
    assert np.abs(first[16:].astype(int) - again[16:]).mean() < 1
    assert len(photo("phone").data) > 2_500_000  # a phone camera's JPEG: noisy, 12 MP
    default = build_media_requests("visual-question", 5, 0, token_counter())
    assert [decode_image_bytes(_media_bytes(r.messages[1]["content"][0]), 10**8).size for r in default] == [
        SIZES[n] for n in DEFAULT_PHOTOS]
    with pytest.raises(ValueError, match="unknown photo 'cat'"):
        photo("cat")


def test_videos_decode_with_frames_and_their_audio_track():
    counter = token_counter()
    plain, with_audio = (build_media_requests(w, 2, 0, counter) for w in ("video", "video-audio"))
    assert (plain[0].extra, with_audio[0].extra) == ({}, {"use_audio_in_video": True})
    assert with_audio[0].messages[1]["content"][1]["text"] == "Answer the question asked in the video."
    clip = decode_audio_bytes(spoken_clip("q03").data)  # video 0's track: 3.9 s, padded to 4 s
    for r in plain + with_audio:
        part = r.messages[1]["content"][0]
        assert part["type"] == "video_url" and part["video_url"]["url"].startswith("data:video/mp4;base64,")
        item = decode_video_bytes(_media_bytes(part), {}, MediaPolicy(), with_audio=True)
        assert item.frames.shape == (8, 240, 320, 3) and (item.total_frames, item.source_fps) == (100, 25.0)
        assert 64000 <= item.audio.size <= 64000 + 2048  # aac: whole 1024-sample frames
    mp4 = _media_bytes(plain[0].messages[1]["content"][0])
    track = decode_video_bytes(mp4, {}, MediaPolicy(), with_audio=True).audio
    assert np.corrcoef(track[1024:1024 + clip.size], clip)[0, 1] > 0.99  # the clip, after aac's 1024 priming
    assert len(mp4) < 500_000


def test_playback_stalls_on_hand_made_timings():
    # 0.25 s, 0.25 s, 0.5 s, 0.5 s, 0.25 s chunks: plays 10.0-10.5, waits 0.5 s, plays 11.0-12.0, waits 1 s
    times, samples = [10.0, 10.25, 11.0, 11.5, 13.0], [6000, 6000, 12000, 12000, 6000]
    assert playback_stalls(times, samples) == (2, 1.5)
    assert playback_stalls([1.0, 1.5, 2.0], [12000, 12000, 12000]) == (0, 0.0)  # each chunk just in time
    assert playback_stalls([5.0], [10]) == (0, 0.0) and playback_stalls([], []) == (0, 0.0)

    def req(send: float, times: list[float], chunks: list[int], ok: bool = True) -> RequestResult:
        return RequestResult(send=send, ok=ok, text_times=[0.01], audio_times=times, audio_chunks=chunks,
                             audio_samples=sum(chunks), end=times[-1] + 0.01)

    results = [req(1.0, [0.2, 0.3], [2400, 2400]),  # smooth
               req(0.5, [t - 10.0 for t in times], samples),  # sent first: TTFP 0 s
               req(2.0, [0.1, 0.9], [2400, 2400]),  # waits 0.7 s
               req(0.0, [0.1, 9.0], [2400, 2400], ok=False)]  # failed: not counted
    row = summarize(results, backend="omnistage", concurrency=3, prompt_tokens=20, start=0.5)
    assert (row["stalled_streams"], row["stall_s"]) == (2, pytest.approx(2.2))
    assert row["mean_stall_ms"] == pytest.approx(2200 / 3) and row["max_stall_ms"] == pytest.approx(1500)
    assert row["p50_stall_ms"] == pytest.approx(700) and row["first_ttfp_ms"] == 0.0
    # late chunks 2 and 4 of the second stream (at 1.5 s and 3.5 s), chunk 1 of the third (2.9 s); row 0.5-3.51 s
    assert row["stalls_by_chunk"] == [1, 1, 0, 1] and row["stalls_by_tenth"] == [0, 0, 0, 1, 0, 0, 0, 1, 0, 1]
    # the audio ran out at 1.0 (waits 0.5 s), 2.2 (0.7 s) and 2.5 (1 s)
    assert row["stall_events"] == [[1.0, 500.0, 2], [2.2, 700.0, 1], [2.5, 1000.0, 4]]


def _bench(*argv: str) -> int:
    return run_bench(add_bench_args(argparse.ArgumentParser()).parse_args(list(argv)))


def test_media_workloads_against_the_tiny_server(server, tiny_dir, tmp_path):
    common = ["--base-url", server.url, "--random-weights", "--max-tokens", "3", "--max-frames", "4",
              "--num-prompts", "2", "--concurrency", "2", "--warmup", "0", "--tokenizer", str(tiny_dir),
              "--output-dir", str(tmp_path), "--time-budget", "120"]
    for workload, extra in (("spoken-question", ["--media", "q01,q02"]),
                            ("visual-question", ["--media", "chelsea"]),
                            ("video", ["--video-seconds", "2"]), ("video-audio", ["--video-seconds", "2"])):
        assert _bench("--workload", workload, *extra, *common) == 0, workload
    rows = {r["workload"]: r for r in json.loads((tmp_path / RESULTS).read_text())["rows"]}
    assert list(rows) == ["spoken-question", "visual-question", "video", "video-audio"]
    audio_s = (4 * 1920 - 555) / 24000  # code2wav: 1920 samples a frame, 555 trimmed once
    for name, r in rows.items():
        assert (r["num_requests"], r["failed"], r["concurrency"]) == (2, 0, 2), r
        assert r["mean_audio_s"] == pytest.approx(audio_s) and r["mean_output_tokens"] == 3
        assert isinstance(r["stalled_streams"], int) and 0 <= r["stalled_streams"] <= 2
        assert r["stall_s"] >= 0 and r["mean_stall_ms"] is not None and r["first_ttfp_ms"] > 0
        assert r["mean_server_prompt_tokens"] > r["prompt_tokens"] + 20, name  # the media's tokens
    assert rows["spoken-question"]["media"] == "q01,q02" and rows["video"]["video_seconds"] == 2.0
    assert rows["video-audio"]["mean_server_prompt_tokens"] > rows["video"]["mean_server_prompt_tokens"]
    table = (tmp_path / TABLE).read_text()
    assert "| stalled | stall s | max stall ms |" in table
    for name in rows:
        assert table.count(f"| omnistage | - | {name} |") == 1


def test_the_peer_runs_read_aloud_only():
    with pytest.raises(SystemExit, match="--backend hf runs the read-aloud workload only, not video"):
        _bench("--backend", "hf", "--workload", "video")
