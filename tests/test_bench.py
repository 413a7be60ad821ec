"""`omnistage bench`: metric arithmetic against a fake SSE server with known timings, budgets, the whole tool against
the real tiny server and the peer, and that a row finds no earlier row's prompt in its prefix cache (the workload's
requests themselves: test_bench_workload.py)."""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import re
import time

import httpx
import numpy as np
import pytest

from omnistage.bench.cli import add_bench_args, run_bench
from omnistage.bench.client import run_requests, send_request
from omnistage.bench.metrics import RequestResult, summarize
from omnistage.bench.report import RESULTS, TABLE
from omnistage.bench.stage_stats import PHASES, REALTIME_PHASES, SERVED_PHASES
from omnistage.server.audio_format import wav_stream_header

pytest_plugins = ["serve_fixtures"]
SLACK = 0.02  # seconds from the fake server's yield to the client's clock (same event loop)
# The fake server's script: (seconds after the request, delta); audio chunks of 0.5 s and 1.0 s.
SCRIPT = [(0.05, {"content": "Hello"}), (0.10, {"audio": {"id": "a1", "data": 12000}}),
          (0.15, {"content": " world"}), (0.30, {"audio": {"data": 24000}})]
AUDIO_S = 1.5


def _chunk(delta: dict, finish: str | None = None) -> bytes:
    return f"data: {json.dumps({'choices': [{'index': 0, 'delta': delta, 'finish_reason': finish}]})}\n\n".encode()


class FakeServer:
    """Streams SCRIPT at its times (never early; a loaded machine may be late) for every request, noting
    when each delta and the end went out (`emitted`); counts requests in flight; keeps the bodies."""

    def __init__(self, wav: bool = False) -> None:
        self.wav, self.bodies, self.emitted, self.in_flight, self.most = wav, [], [], 0, 0

    async def _events(self):
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        start, emitted = time.perf_counter(), []
        self.emitted.append(emitted)
        yield _chunk({"role": "assistant", "content": ""})
        for i, (at, delta) in enumerate(SCRIPT):
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - start)))
            if "audio" in delta:
                pcm = np.arange(delta["audio"]["data"], dtype="<i2").tobytes()
                pcm = wav_stream_header() + pcm if self.wav and i == 1 else pcm
                delta = {"audio": {**delta["audio"], "data": base64.b64encode(pcm).decode()}}
            emitted.append(time.perf_counter())
            yield _chunk(delta)
        yield _chunk({}, "stop")
        usage = {"prompt_tokens": 173, "completion_tokens": 21,
                 "completion_tokens_details": {"text_tokens": 2, "audio_tokens": 19}}
        self.in_flight -= 1  # NOTE: before the last chunk: the client closes the stream at [DONE]
        emitted.append(time.perf_counter())
        yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode()

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        self.bodies.append(json.loads(request.content))
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=self._events())


def _client(fake: FakeServer) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url="http://fake", transport=httpx.MockTransport(fake))


def _near(value: float, expected: float) -> bool:
    return expected - 1e-3 <= value <= expected + SLACK


def _near_gap(value: float, expected: float) -> bool:
    """A gap between two client clocks: the earlier one may be late by up to SLACK too."""
    return expected - SLACK <= value <= expected + SLACK


@pytest.mark.parametrize("wav", [False, True])
def test_request_metrics_from_known_timings(wav):
    fake = FakeServer(wav)

    async def go() -> RequestResult:
        async with _client(fake) as client:
            return await send_request(client, {"stream": True})

    r = asyncio.run(go())
    assert r.ok, r.error
    text1, audio1, text2, audio2, end = (t - r.send for t in fake.emitted[0])
    assert [text1, audio1, text2, audio2] >= [at for at, _ in SCRIPT]
    v = r.values()
    assert r.audio_samples == 36000 and r.audio_s == AUDIO_S  # a wav stream's 44-byte header is not audio
    assert _near(v["ttft"][0], text1) and _near(v["ttfp"][0], audio1)  # the empty role delta is not text
    assert _near(v["rtf"][0] * AUDIO_S, audio2) and _near(v["e2e"][0], end)
    assert _near_gap(v["icg"][0], audio2 - audio1) and _near_gap(v["itl"][0], text2 - text1)
    assert len(v["icg"]) == len(v["itl"]) == 1 and (r.prompt_tokens, r.output_tokens) == (173, 2)
    assert r.audio_chunks == [12000, 24000] and v["stall"] == [0.0]  # chunk 1 plays until 0.60, 2 at 0.30


def test_row_throughput_and_concurrency_from_known_timings():
    fake = FakeServer()

    async def go() -> tuple[list[RequestResult], int, float]:
        async with _client(fake) as client:
            start = time.perf_counter()
            results, cancelled = await run_requests(client, [{"i": i} for i in range(4)], 2, start + 60, start + 60)
            return results, cancelled, start

    results, cancelled, start = asyncio.run(go())
    row = summarize(results, backend="omnistage", concurrency=2, prompt_tokens=160, start=start)
    assert fake.most == 2 and cancelled == 0 and row["num_requests"] == 4 and row["failed"] == 0
    last_end = max(e[-1] for e in fake.emitted) - start
    assert _near(row["duration_s"], last_end) and last_end >= 2 * SCRIPT[-1][0]  # two waves of two
    assert row["request_throughput"] == pytest.approx(4 / row["duration_s"])
    assert row["audio_throughput"] == pytest.approx(4 * AUDIO_S / row["duration_s"])
    first_audio = [e[1] - r.send for e, r in zip(sorted(fake.emitted), sorted(results, key=lambda r: r.send))]
    assert _near(row["mean_ttfp_ms"] / 1e3, float(np.mean(first_audio)))
    assert row["mean_server_prompt_tokens"] == 173 and row["total_audio_s"] == 4 * AUDIO_S


def test_summarize_arithmetic():
    def req(send: float, ttfp: float, ok: bool = True) -> RequestResult:
        return RequestResult(send=send, ok=ok, text_times=[ttfp / 2], audio_times=[ttfp, 2 * ttfp],
                             audio_samples=48000, end=3 * ttfp)

    results = [req(10.0, 0.1), req(10.0, 0.2), req(10.5, 0.3), req(11.0, 0.4), req(10.0, 9.0, ok=False)]
    row = summarize(results, backend="hf", concurrency=4, prompt_tokens=10, start=10.0, cancelled=1)
    assert (row["num_requests"], row["failed"], row["cancelled"]) == (4, 1, 1)
    assert row["duration_s"] == pytest.approx(2.2)  # last finish: 11.0 + 3 * 0.4
    assert row["request_throughput"] == pytest.approx(4 / 2.2)
    assert row["audio_throughput"] == pytest.approx(8 / 2.2)
    assert row["mean_ttfp_ms"] == pytest.approx(250) and row["p50_ttfp_ms"] == pytest.approx(250)
    assert row["p90_ttfp_ms"] == pytest.approx(370) and row["p99_ttfp_ms"] == pytest.approx(397)
    assert row["mean_ttft_ms"] == pytest.approx(125) and row["mean_e2e_ms"] == pytest.approx(750)
    assert row["mean_rtf"] == pytest.approx(0.25)  # last chunk at 2 x TTFP, 2 s of audio
    assert row["mean_icg_ms"] == pytest.approx(250) and row["mean_itl_ms"] is None


def test_budget_stops_sending_and_cancels_what_runs_past_it():
    fake = FakeServer()

    async def go(stop: float, give_up: float) -> tuple[list[RequestResult], int]:
        async with _client(fake) as client:
            now = time.perf_counter()
            return await run_requests(client, [{}] * 4, 2, now + stop, now + give_up)

    assert asyncio.run(go(-1, 5)) == ([], 0) and fake.bodies == []
    results, cancelled = asyncio.run(go(0.05, 0.15))  # two sent at once, both cut off mid-stream
    assert results == [] and cancelled == 2 and len(fake.bodies) == 2


def _bench(*argv: str) -> int:
    return run_bench(add_bench_args(argparse.ArgumentParser()).parse_args(list(argv)))


def test_bench_end_to_end_against_the_tiny_server_and_the_peer(server, tiny_dir, tmp_path):
    frames, tokens = 6, 4
    common = ["--random-weights", "--max-tokens", str(tokens), "--max-frames", str(frames), "--num-prompts", "2",
              "--tokenizer", str(tiny_dir), "--output-dir", str(tmp_path), "--time-budget", "120"]
    assert _bench("--base-url", server.url, "--prompt-tokens", "10,160", "--concurrency", "1,2", "--warmup", "1",
                  *common) == 0
    assert _bench("--backend", "hf", "--model-dir", str(tiny_dir), "--device", "cpu", "--prompt-tokens", "10",
                  "--concurrency", "1,2", "--warmup", "0", *common) == 0
    assert _bench("--base-url", server.url, "--prompt-tokens", "10", "--concurrency", "2", "--warmup", "0",
                  "--variant", "ablation-x", "--prompts-per-concurrency", "2", *common) == 0
    results = json.loads((tmp_path / RESULTS).read_text())
    meta, rows = results["meta"], results["rows"]
    assert {"date", "commit", "device", "gpus", "workload", "command"} <= set(meta) and len(meta["runs"]) == 3
    variant = rows.pop()
    assert (variant["backend"], variant["variant"], variant["concurrency"], variant["num_requests"]) == (
        "omnistage", "ablation-x", 2, 4)  # 2 x c requests
    assert meta["runs"][2]["prompts_per_concurrency"] == 2
    assert [(r["backend"], r["prompt_tokens"], r["concurrency"]) for r in rows] == [
        ("omnistage", 10, 1), ("omnistage", 10, 2), ("omnistage", 160, 1), ("omnistage", 160, 2), ("hf", 10, 1),
        ("hf", 10, 2)]
    audio_s = (frames * 1920 - 555) / 24000  # code2wav: 1920 samples a frame, 555 trimmed once
    for r in rows:
        assert (r["num_requests"], r["failed"], r["workload"]) == (2, 0, "read-aloud"), r
        assert r["stalled_streams"] in (0, 1, 2) and r["stall_s"] >= 0 and r["mean_stall_ms"] is not None
        assert r["mean_audio_s"] == pytest.approx(audio_s) and r["mean_output_tokens"] == tokens
        assert r["prompt_tokens"] < r["mean_server_prompt_tokens"] <= r["prompt_tokens"] + 14
        assert 0 < r["mean_ttft_ms"] <= r["mean_ttfp_ms"] <= r["mean_e2e_ms"]
        assert r["mean_rtf"] == pytest.approx(r["mean_e2e_ms"] / 1e3 / audio_s, rel=0.5)
        assert r["request_throughput"] > 0
    for r in rows[:4]:  # the server's step counters over each row
        st = r["stages"]
        assert set(st) == {"thinker", "talker", "code2wav"}
        assert 1 <= st["talker"]["mean_batch"] <= r["concurrency"] and 0 < st["talker"]["busy_fraction"] <= 1.05
        assert st["talker"]["steps_per_s"] * st["talker"]["mean_step_ms"] / 1e3 == pytest.approx(
            st["talker"]["busy_fraction"])
        ph = r["phases_ms"]
        chat_phases = [p for p in PHASES if p not in REALTIME_PHASES]
        assert sorted(set(ph) - set(SERVED_PHASES), key=ph.get) == chat_phases, ph
        assert 0 <= ph["thinker_start"] <= r["mean_ttfp_ms"], ph
        # the handler takes each first delta after the engine made it, and the client after the handler
        assert ph["first_token"] <= ph["served_token"] <= r["mean_ttft_ms"], ph
        assert ph["first_audio"] <= ph["served_audio"] <= r["mean_ttfp_ms"], ph
    assert "stages" not in rows[4] and "phases_ms" not in rows[4]
    assert rows[4]["mean_ttft_ms"] == rows[4]["mean_ttfp_ms"] == rows[4]["mean_e2e_ms"]
    assert sum(bool(r.get("best_batch")) for r in rows) == 1
    table = (tmp_path / TABLE).read_text()
    assert table.count("\n| omnistage |") == 5 and table.count("\n| hf |") == 2
    assert "Where the time goes" in table and table.count(" | talker | ") == 5
    # no graphs on the CPU: no captures; the talker's KV waits and swaps; code2wav has no paged KV
    assert len(re.findall(r"^\|[^\n]* \| talker \|( [^|]+ \|){6} - \| \d+ \| \d+ \|$", table, re.M)) == 5
    assert len(re.findall(r"^\|[^\n]* \| code2wav \|( [^|]+ \|){6} - \| - \| - \|$", table, re.M)) == 5
    parts = table[table.index("TTFP's parts"):]
    assert "| variant | workload | P | c | " + " | ".join(chat_phases + list(SERVED_PHASES)) + " |" in parts
    assert len(re.findall(r"^\| (ablation-x)? \| read-aloud \| (10|160) \| [12] \|( \d+ \|){11}$", parts,
                          re.M)) == 5
    ablation = r"^\| omnistage \| ablation-x \| read-aloud \| - \| 10 \| \d+ \| 2 \| 4 \|"
    assert len(re.findall(ablation, table, re.M)) == 1
    for name in ("throughput.png", "ttfp.png", "rtf.png"):
        png = (tmp_path / name).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def test_a_row_finds_an_earlier_rows_prompts_in_the_prefix_cache_only_when_repeated(server, tiny_dir, tmp_path):
    def thinker_cache() -> tuple[float, float]:  # prompt tokens looked up and found (the server's counters)
        text = httpx.get(server.url + "/metrics").text
        found = [re.search(rf'^omnistage_prefix_cache_{k}_total{{stage="thinker"}} (\S+)$', text, re.M)
                 for k in ("queries", "hits")]
        return float(found[0][1]), float(found[1][1])

    def row_hit_share(*flags: str) -> float:  # the share of a row's looked-up prompt tokens the cache had
        before = thinker_cache()
        assert _bench("--base-url", server.url, "--random-weights", "--tokenizer", str(tiny_dir), "--prompt-tokens",
                      "160", "--concurrency", "1", "--num-prompts", "2", "--warmup", "0", "--max-tokens", "1",
                      "--max-frames", "2", "--output-dir", str(tmp_path), *flags) == 0
        queries, hits = (a - b for a, b in zip(thinker_cache(), before))
        assert queries >= 2 * 144  # two prompts of 9+ full blocks of 16
        return hits / queries

    tagged = [row_hit_share() for _ in range(2)]
    repeated = [row_hit_share("--repeat-prompts") for _ in range(2)]
    assert max(tagged) < 0.35  # the system prompt's blocks (3 of 10): each row's prompts are new
    assert repeated[1] > 0.85  # all but each prompt's last block: the row before sent the same prompts
