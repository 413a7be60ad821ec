"""Streaming chat-completion requests against an OpenAI-compatible endpoint, timed on the client.

Audio is asked as "pcm16" (raw s16le 24 kHz mono, base64 per chunk); a "wav" stream's header is
skipped, so either kind of server is measured alike.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import Callable

import httpx

from omnistage.bench.metrics import RequestResult
from omnistage.bench.workload import BenchRequest, forced_lengths

WAV_HEADER_BYTES = 44
CHAT_PATH = "/v1/chat/completions"


def chat_payload(req: BenchRequest, *, model: str | None, random_weights: bool, voice: str = "Ethan",
                 max_tokens: int | None = None, max_frames: int | None = None, answer_scale: float = 1.0) -> dict:
    """The request body: text + streamed audio, usage asked; random weights force the output lengths with
    EOS ignored (thinker: max_tokens + ignore_eos; talker: talker.max_frames + talker.ignore_eos)."""
    body: dict = {"messages": req.messages, "modalities": ["text", "audio"],
                  "audio": {"voice": voice, "format": "pcm16"}, "stream": True,
                  "stream_options": {"include_usage": True}, "seed": req.seed, **req.extra}
    if model:
        body["model"] = model
    if random_weights:
        text, frames = forced_lengths(req, max_tokens, max_frames, answer_scale)
        body.update(max_tokens=text, ignore_eos=True, talker={"max_frames": frames, "ignore_eos": True})
    else:
        body.update({k: v for k, v in (("max_tokens", max_tokens), ("max_audio_frames", max_frames)) if v})
    return body


def _pcm_bytes(data: str, first: bool) -> int:
    raw = base64.b64decode(data)
    return len(raw) - (WAV_HEADER_BYTES if first and raw[:4] == b"RIFF" else 0)


def _take(event: dict, res: RequestResult, now: float) -> None:
    """Fold one SSE event into the result."""
    if "error" in event:
        err = event["error"]
        raise RuntimeError(str(err.get("message", err) if isinstance(err, dict) else err))
    if event.get("usage"):
        res.prompt_tokens = event["usage"].get("prompt_tokens")
        details = event["usage"].get("completion_tokens_details") or {}
        res.output_tokens = details.get("text_tokens", event["usage"].get("completion_tokens"))
    for choice in event.get("choices") or []:
        delta = choice.get("delta") or {}
        if delta.get("content"):
            res.text_times.append(now)
        data = (delta.get("audio") or {}).get("data")
        if data:
            res.audio_chunks.append(_pcm_bytes(data, not res.audio_times) // 2)
            res.audio_samples += res.audio_chunks[-1]
            res.audio_times.append(now)


async def served_model(client: httpx.AsyncClient) -> str | None:
    """The first model the server lists, or None."""
    try:
        resp = await client.get("/v1/models")
        return resp.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, LookupError):  # the name is optional in the request
        return None


async def send_request(client: httpx.AsyncClient, body: dict, headers: dict[str, str] | None = None
                       ) -> RequestResult:
    """POST one streaming request and time its chunks; failures come back as `ok=False` with the error."""
    res = RequestResult(send=time.perf_counter())
    try:
        async with client.stream("POST", CHAT_PATH, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                raise RuntimeError(f"HTTP {resp.status_code}: {text[:300]}")
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                _take(json.loads(payload), res, time.perf_counter() - res.send)
        res.ok = True
    except (httpx.HTTPError, RuntimeError, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"
    res.end = time.perf_counter() - res.send
    return res


async def run_requests(client: httpx.AsyncClient, bodies: list[dict], concurrency: int, stop_sending: float,
                       give_up: float, headers: dict[str, str] | None = None,
                       on_done: Callable[[], None] | None = None) -> tuple[list[RequestResult], int]:
    """Send `bodies` with at most `concurrency` in flight; none is sent after perf_counter() `stop_sending`;
    those still running at `give_up` are cancelled. Returns (results of the requests sent, cancelled)."""
    gate = asyncio.Semaphore(concurrency)
    in_flight = 0

    async def one(body: dict) -> RequestResult | None:
        nonlocal in_flight
        async with gate:
            if time.perf_counter() >= stop_sending:
                return None
            in_flight += 1
            res = await send_request(client, body, headers)
            in_flight -= 1
            return res

    tasks = [asyncio.create_task(one(b)) for b in bodies]
    if on_done is not None:
        for t in tasks:
            t.add_done_callback(lambda t: None if t.cancelled() or t.result() is None else on_done())
    timeout = None if give_up == float("inf") else max(0.0, give_up - time.perf_counter())
    done, pending = await asyncio.wait(tasks, timeout=timeout)
    cancelled = in_flight
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    return [r for t in done if (r := t.result()) is not None], cancelled
