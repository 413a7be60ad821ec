"""Soak test: a steady mix of clients against `omnistage serve` on the tiny checkpoint for a while, checking
that every request ends as it should and that memory and KV usage stay flat.

    python scripts/soak.py --duration 600 --concurrency 16 --out soak.json      # the 10-minute run
    python scripts/soak.py --duration 60                                         # CI's (tests/test_soak.py)

It starts its own server (CPU) with fault injection: a request whose text holds FAULT_THINKER (or
FAULT_TALKER) fails inside the thinker (talker) after two tokens (frames). The mix: streamed text + audio,
whole text, speech, streams dropped after their first audio chunk, invalid requests (each must get its 4xx),
fault-injected requests (each must fail alone: a 500 or an error event). /metrics is sampled every few
seconds (KV blocks in use, requests held per stage, the server's RSS). Exit 1 on any unexpected outcome,
on KV blocks or requests still held once idle, or on RSS growth past --max-rss-growth-mb.

The server runs with glibc's mmap threshold fixed (MALLOC_MMAP_THRESHOLD_), so that freed buffers go
back to the system and RSS follows live memory: with the default dynamic threshold, 60-s runs with no leak
moved RSS by 20 to 279 MB (freed buffers kept in the heap until a trim that may not come); with it, 21 to
36 MB (warm-up).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import random
import re
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

FAULT_THINKER, FAULT_TALKER = "FAULT_THINKER", "FAULT_TALKER"
TOKENS, FRAMES = 12, 12  # ignore_eos: every answer has exactly this many text tokens and codec frames
SAMPLES = FRAMES * 1920 - 555
USER = [{"role": "user", "content": "Tell me about the sea."}]
AUDIO = {"modalities": ["text", "audio"], "max_audio_frames": FRAMES, "talker": {"ignore_eos": True}}
BAD = [{"messages": []}, {"messages": USER, "max_tokens": 0}, {"messages": USER, "temperature": "hot"},
       {"messages": USER, "frobnicate": 1}, {"messages": USER, **AUDIO, "audio": {"voice": "nobody"}},
       {"messages": USER, "seed": 2**64}, {"messages": USER, "max_tokens": 10**9},
       *({"messages": [{"role": "user", "content": [part]}]} for part in (
           {"type": "audio_url", "audio_url": {"url": "file:///etc/passwd"}},
           {"type": "audio_url", "audio_url": {"url": "http://127.0.0.1/"}},
           {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}))]
KINDS = [("stream", 40), ("text", 20), ("speech", 15), ("drop", 10), ("bad", 10), ("fault", 5)]


def serve_with_faults(serve_args: list[str]) -> None:
    """`omnistage serve`, with the thinker and talker failing marked requests (per-request faults)."""
    from omnistage.pipeline.orchestrator import Orchestrator
    from omnistage.pipeline.talker.stage import TalkerStage
    from omnistage.pipeline.thinker.stage import ThinkerStage
    from omnistage.server.launch import serve
    from omnistage.server.serve_args import add_serve_args

    marked: dict[str, str] = {}
    make_request, append, advance = Orchestrator.make_request, ThinkerStage._append, TalkerStage._advance

    def mark(self, request_id, messages, *args, **kwargs):
        text = json.dumps(messages)
        marked.update({request_id: m for m in (FAULT_THINKER, FAULT_TALKER) if m in text})
        return make_request(self, request_id, messages, *args, **kwargs)

    def faulty_append(self, seq, *args):
        if marked.get(seq.req.request_id) == FAULT_THINKER and len(seq.output_ids) >= 2:
            raise RuntimeError("injected thinker fault")
        return append(self, seq, *args)

    def faulty_advance(self, seq, *args):
        if marked.get(seq.req.request_id) == FAULT_TALKER and seq.frames >= 2:
            raise RuntimeError("injected talker fault")
        return advance(self, seq, *args)

    Orchestrator.make_request = mark
    ThinkerStage._append, TalkerStage._advance = faulty_append, faulty_advance
    serve(add_serve_args(argparse.ArgumentParser()).parse_args(serve_args))


class Soak:
    def __init__(self, url: str, seed: int) -> None:
        self.url, self.rng, self.lock = url, random.Random(seed), threading.Lock()
        self.outcomes: Counter = Counter()
        self.unexpected: list[str] = []

    def pick(self) -> str:
        with self.lock:
            return self.rng.choices([k for k, _ in KINDS], [w for _, w in KINDS])[0]

    def record(self, kind: str, ok: bool, detail: str = "") -> None:
        with self.lock:
            self.outcomes[kind, ok] += 1
            if not ok and len(self.unexpected) < 50:
                self.unexpected.append(f"{kind}: {detail[:300]}")

    def client(self, deadline: float) -> None:
        with httpx.Client(base_url=self.url, timeout=120) as http:
            while time.monotonic() < deadline:
                kind = self.pick()
                try:
                    ok, detail = getattr(self, f"_{kind}")(http)
                except httpx.HTTPError as e:
                    ok, detail = False, repr(e)
                self.record(kind, ok, detail)

    def _chat(self, http: httpx.Client, body: dict) -> httpx.Response:
        return http.post("/v1/chat/completions", json={"max_tokens": TOKENS, "ignore_eos": True, **body})

    def _stream(self, http: httpx.Client, text: str = "Tell me about the sea.", drop: bool = False) -> tuple:
        body = {"messages": [{"role": "user", "content": text}], "max_tokens": TOKENS, "ignore_eos": True,
                **AUDIO, "audio": {"format": "pcm16"}, "stream": True,
                "stream_options": {"include_usage": True}}
        pcm, events = 0, []
        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
                    audio = (events[-1].get("choices") or [{}])[0].get("delta", {}).get("audio") or {}
                    pcm += len(base64.b64decode(audio.get("data", "")))
                    if drop and pcm:
                        return True, ""  # leaving the block closes the connection mid-audio
        if drop:
            return False, "the stream ended before any audio"
        if any("error" in e for e in events):
            return False, f"error event: {events[-1]}"
        usage = events[-1].get("usage") or {}
        ok = pcm == 2 * SAMPLES and usage.get("completion_tokens") == TOKENS + FRAMES
        return ok, f"pcm bytes {pcm}, usage {usage}"

    def _drop(self, http: httpx.Client) -> tuple:
        return self._stream(http, drop=True)

    def _text(self, http: httpx.Client) -> tuple:
        r = self._chat(http, {"messages": USER})
        return r.status_code == 200 and r.json()["usage"]["completion_tokens"] == TOKENS, r.text

    def _speech(self, http: httpx.Client) -> tuple:
        r = http.post("/v1/audio/speech", json={"input": "The sea is calm.", "max_tokens": TOKENS,
                                                  "max_audio_frames": FRAMES, "talker": {"ignore_eos": True}})
        return r.status_code == 200 and r.content[:4] == b"RIFF" and len(r.content) == 44 + 2 * SAMPLES, \
            f"{r.status_code} {len(r.content)}"

    def _bad(self, http: httpx.Client) -> tuple:
        with self.lock:
            body = self.rng.choice(BAD)
        r = http.post("/v1/chat/completions", json=body)
        return r.status_code in (400, 404) and set(r.json().get("error", {})) == {"message", "type", "param",
                                                                                   "code"}, r.text

    def _fault(self, http: httpx.Client) -> tuple:
        with self.lock:
            marker, stream = self.rng.choice([FAULT_THINKER, FAULT_TALKER]), self.rng.random() < 0.5
        if stream:
            ok, detail = self._stream(http, text=f"Say {marker}.")
            return not ok and detail.startswith("error event"), detail
        r = self._chat(http, {"messages": [{"role": "user", "content": f"Say {marker}."}], **AUDIO})
        return r.status_code == 500 and r.json()["error"]["type"] == "server_error", r.text


def sample(url: str) -> dict:
    text = httpx.get(url + "/metrics", timeout=10).text

    def per_stage(name: str) -> dict[str, float]:
        return {m[1]: float(m[2]) for m in re.finditer(rf'{name}\{{stage="(\w+)"\}} (\S+)', text)}

    rss = re.search(r"^process_resident_memory_bytes (\S+)", text, re.M)
    return {"t": time.monotonic(), "kv_in_use": per_stage("omnistage_kv_cache_blocks_in_use"),
            "active": per_stage("omnistage_stage_requests_active"),
            "rss_mb": float(rss[1]) / 2**20 if rss else 0}


def run(args: argparse.Namespace) -> dict:
    soak, samples = Soak(args.url, args.seed), []
    deadline = time.monotonic() + args.duration
    threads = [threading.Thread(target=soak.client, args=(deadline,)) for _ in range(args.concurrency)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        samples.append(sample(args.url))
        time.sleep(args.sample_every)
    for t in threads:
        t.join()
    idle = sample(args.url)
    for _ in range(100):  # the last aborts reach every stage within a step; allow the server a moment
        if not any(idle["kv_in_use"].values()) and not any(idle["active"].values()):
            break
        time.sleep(0.1)
        idle = sample(args.url)
    rss = [s["rss_mb"] for s in samples]
    k = max(1, len(rss) // 5)
    # NOTE: medians: RSS moves ±100 MB between samples with transient buffers; a leak moves the median
    early, late = statistics.median(rss[k:2 * k]), statistics.median(rss[-k:])  # after warm-up vs the end

    def kv_mean(window: list[dict]) -> dict[str, float]:
        return {s: round(sum(x["kv_in_use"].get(s, 0) for x in window) / len(window), 1)
                for s in idle["kv_in_use"]}
    return {"duration_s": args.duration, "concurrency": args.concurrency,
            "outcomes": {f"{kind} {'ok' if ok else 'UNEXPECTED'}": n
                         for (kind, ok), n in sorted(soak.outcomes.items())},
            "requests": sum(soak.outcomes.values()), "unexpected": soak.unexpected,
            "kv_in_use_peak": {s: max(x["kv_in_use"].get(s, 0) for x in samples) for s in idle["kv_in_use"]},
            "kv_in_use_mean": {"early": kv_mean(samples[k:2 * k]), "late": kv_mean(samples[-k:])},
            "kv_in_use_idle": idle["kv_in_use"], "active_idle": idle["active"],
            "rss_mb": {"early": round(early, 1), "late": round(late, 1), "max": round(max(rss), 1),
                       "growth": round(late - early, 1),
                       "series": [round(x) for x in rss[::max(1, len(rss) // 12)]]},
            "samples": len(samples)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=600, help="seconds of load")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--sample-every", type=float, default=5.0)
    p.add_argument("--max-rss-growth-mb", type=float, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=8097)
    p.add_argument("--out", default=None, help="write the summary JSON here too")
    args = p.parse_args(argv)
    args.url = f"http://127.0.0.1:{args.port}"
    log = Path(args.out or "soak").with_suffix(".server.log")
    cmd = [sys.executable, __file__, "serve-with-faults", "--host", "127.0.0.1", "--port", str(args.port),
           "--device", "cpu"]
    env = {"MALLOC_MMAP_THRESHOLD_": "131072", **os.environ}
    server = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    try:
        for _ in range(600):
            try:
                if httpx.get(args.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
            if server.poll() is not None:
                raise SystemExit(f"the server exited; see {log}")
        summary = run(args)
    finally:
        server.terminate()
        server.wait(30)
    text = json.dumps(summary, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    leaked = any(summary["kv_in_use_idle"].values()) or any(summary["active_idle"].values())
    return int(bool(summary["unexpected"]) or leaked or summary["rss_mb"]["growth"] > args.max_rss_growth_mb)


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve-with-faults"]:
        serve_with_faults(sys.argv[2:])
    else:
        sys.exit(main())
