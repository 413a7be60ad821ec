"""`omnistage bench --realtime`: N sessions over /v1/realtime (websockets), each speaking the shipped question
clips (bench/speech.py) at real-time pace in `--append-ms` appends, then silence, with server VAD on; the
server's turns, answers and barge-ins are timed per turn (realtime_metrics.py). Idle sessions (connected,
streaming silence) can run beside a realtime or a chat sweep (`--idle-sessions`).
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import sys
import time
from collections import deque
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import numpy as np

from omnistage.bench.realtime_metrics import Turn, summarize_turns
from omnistage.bench.speech import speech_clip, speech_only, turn_clips
from omnistage.outputs import SAMPLE_RATE

PCM = {"type": "audio/pcm", "rate": SAMPLE_RATE}
RANDOM_WEIGHTS_MAX_TOKENS = 24  # thinker tokens of a random-weight answer (its audio: --max-frames)


def realtime_url(base_url: str, model: str | None) -> str:
    url = base_url.rstrip("/").replace("https://", "wss://").replace("http://", "ws://") + "/v1/realtime"
    return f"{url}?model={model}" if model else url


def session_patch(args, ignore_eos: bool) -> dict:
    """session.update's `session`: pcm16 24 kHz both ways, server_vad, fixed-length answers."""
    vad = {"type": "server_vad", "threshold": 0.5, "prefix_padding_ms": 300,
           "silence_duration_ms": args.silence_ms, "create_response": True, "interrupt_response": True}
    max_tokens = args.max_tokens or (RANDOM_WEIGHTS_MAX_TOKENS if args.random_weights else None)
    patch = {"type": "realtime", "output_modalities": ["audio"],
             "audio": {"input": {"format": PCM, "turn_detection": vad},
                       "output": {"format": PCM, "voice": args.voice}},
             "max_output_tokens": max_tokens or "inf"}
    if args.max_frames:
        patch["max_audio_frames"] = args.max_frames
    if ignore_eos:
        patch["ignore_eos"] = True  # NOTE: an extension the server may not have (then answers may end early)
    return patch


@dataclass(eq=False)
class _Live:
    turn: Turn = field(default_factory=Turn)
    answered: asyncio.Event = field(default_factory=asyncio.Event)
    finished: asyncio.Event = field(default_factory=asyncio.Event)


class Session:
    """One socket: a microphone task sending audio (speech queued by `speak`, else silence) every append_s,
    and a receiver folding server events into the turns."""

    def __init__(self, ws, append_s: float) -> None:
        self.ws, self.append_s = ws, append_s
        self.errors: list[str] = []
        self.extra_turns = 0  # speech_stopped with no turn waiting (the VAD split a clip)
        self.updated = asyncio.Event()
        self.ignore_eos = False  # whether the server took the extension
        self._chunks: deque[tuple[bytes, asyncio.Future | None]] = deque()
        self._wait_vad: deque[_Live] = deque()
        self._wait_response: deque[_Live] = deque()
        self._by_response: dict[str, _Live] = {}
        self._tasks = [asyncio.create_task(self._mic()), asyncio.create_task(self._receive())]

    async def send(self, type_: str, **fields) -> None:
        await self.ws.send(json.dumps({"type": type_, **fields}))

    def speak(self, pcm: np.ndarray, live: _Live) -> tuple[asyncio.Future, asyncio.Future]:
        """Queue speech; futures of the perf_counter() times its first and last appends went out."""
        n = round(self.append_s * SAMPLE_RATE)
        loop = asyncio.get_running_loop()
        first, last = loop.create_future(), loop.create_future()
        pieces = [pcm[i:i + n].tobytes() for i in range(0, pcm.size, n)]
        self._chunks.extend((p, first if i == 0 else last if i == len(pieces) - 1 else None)
                            for i, p in enumerate(pieces))
        self._wait_vad.append(live)
        return first, last

    async def _mic(self) -> None:
        silence = bytes(2 * round(self.append_s * SAMPLE_RATE))
        t0 = time.perf_counter()
        for k in itertools.count():
            data, mark = self._chunks.popleft() if self._chunks else (silence, None)
            await self.send("input_audio_buffer.append", audio=base64.b64encode(data).decode())
            if mark is not None:
                mark.set_result(time.perf_counter())
            await asyncio.sleep(max(0.0, t0 + (k + 1) * self.append_s - time.perf_counter()))

    async def _receive(self) -> None:
        async for message in self.ws:
            self._take(json.loads(message), time.perf_counter())

    def _take(self, ev: dict, now: float) -> None:
        kind = ev.get("type")
        if kind == "session.updated":
            self.updated.set()
        elif kind == "error":
            self.errors.append(f"{ev['error'].get('param')}: {ev['error'].get('message')}")
            self.updated.set()
        elif kind == "input_audio_buffer.speech_stopped":
            if not self._wait_vad:
                self.extra_turns += 1
                return
            live = self._wait_vad.popleft()
            live.turn.vad_stop = now
            self._wait_response.append(live)
        elif kind == "response.created":
            live = self._wait_response.popleft() if self._wait_response else _Live()
            self._by_response[ev["response"]["id"]] = live
        elif kind == "response.output_audio.delta":
            live = self._by_response[ev["response_id"]]
            live.turn.deltas.append((now, len(base64.b64decode(ev["delta"])) // 2))
            live.answered.set()
        elif kind == "response.done":
            live = self._by_response.pop(ev["response"]["id"], None) or _Live()
            live.turn.done, live.turn.status = now, ev["response"]["status"]
            live.finished.set()

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.ws.close()


@asynccontextmanager
async def connect(args, model: str | None):
    """An open Session with the bench's settings (ignore_eos dropped when the server does not know it)."""
    from websockets.asyncio.client import connect as ws_connect

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    async with ws_connect(realtime_url(args.base_url, model), additional_headers=headers, max_size=None) as ws:
        session = Session(ws, args.append_ms / 1000)
        for ignore_eos in ((True, False) if args.random_weights else (False,)):
            session.errors.clear()
            session.updated.clear()
            await session.send("session.update", session=session_patch(args, ignore_eos))
            await asyncio.wait_for(session.updated.wait(), 30)
            if not session.errors:
                session.ignore_eos = ignore_eos
                break
        try:
            yield session
        finally:
            await session.close()


async def converse(session: Session, clips: list[np.ndarray], barge_in_every: int, gap_s: float,
                   timeout: float) -> list[Turn]:
    """Speak the clips turn after turn; before turn i (1-based) with i % barge_in_every == 0 the previous
    answer is interrupted: turn i's speech starts as soon as that answer's first audio came."""
    lives = [_Live() for _ in clips]
    spoken: dict[int, tuple[asyncio.Future, asyncio.Future]] = {}
    try:
        for i, (pcm, live) in enumerate(zip(clips, lives)):
            first, last = spoken.get(i) or session.speak(pcm, live)
            live.turn.speech_end = await asyncio.wait_for(last, timeout)
            if barge_in_every and i + 1 < len(clips) and (i + 2) % barge_in_every == 0:
                await asyncio.wait_for(live.answered.wait(), timeout)
                spoken[i + 1] = session.speak(clips[i + 1], lives[i + 1])
                live.turn.barge_send = await spoken[i + 1][0]
            await asyncio.wait_for(live.finished.wait(), timeout)
            if i + 1 not in spoken:
                await asyncio.sleep(gap_s)
    except TimeoutError:
        errors = "; ".join(session.errors) or "no error event"
        for live in lives:
            if not live.finished.is_set():
                live.turn.error = f"timed out ({errors})"
    return [live.turn for live in lives]


async def _row(args, model: str | None, sessions: int, clip: str, turns: int) -> dict:
    pcm = speech_only(speech_clip(clip))  # the speech end is its last sample sent

    async def one(k: int) -> tuple[list[Turn], Session]:
        clips = turn_clips(pcm, turns, args.repeat_media)
        async with connect(args, model) as session:
            await asyncio.sleep(0.5 + args.stagger_s * k / max(1, sessions))
            return await converse(session, clips, args.barge_in_every, args.turn_gap_s, args.turn_timeout), session

    start = time.perf_counter()
    results = await asyncio.gather(*[one(k) for k in range(sessions)])
    row = summarize_turns([t for got, _ in results for t in got], sessions=sessions, clip=clip,
                          turn_s=pcm.size / SAMPLE_RATE, idle_sessions=args.idle_sessions, start=start,
                          end=time.perf_counter())
    row["extra_turns"] = sum(s.extra_turns for _, s in results)
    row["ignore_eos"] = all(s.ignore_eos for _, s in results)
    row["stagger_s"] = args.stagger_s
    return row


@asynccontextmanager
async def idle_sessions(args, model: str | None):
    """`args.idle_sessions` sessions streaming silence while the block runs."""
    stop = asyncio.Event()
    ready = [asyncio.Event() for _ in range(args.idle_sessions)]

    async def idle(up: asyncio.Event) -> None:
        async with connect(args, model):
            up.set()
            await stop.wait()

    tasks = [asyncio.create_task(idle(up)) for up in ready]
    try:
        await asyncio.wait_for(asyncio.gather(*[up.wait() for up in ready]), 60)  # all connected first
        yield
    finally:
        stop.set()
        await asyncio.gather(*tasks)


async def realtime_sweep(args, model: str | None, client=None) -> list[dict]:
    """The rows; with `client` (httpx, the server's base URL) each gets the server's stage and phase figures
    over it (as chat rows do: /metrics before and after)."""
    from omnistage.bench.stage_stats import row_server_stats, scrape_server_counters

    rows = []
    async with idle_sessions(args, model):
        if args.warmup:
            await _row(args, model, 1, args.clips[0], 1)
        for clip in args.clips:
            for c in args.concurrency:
                before = client and await scrape_server_counters(client)
                rows.append(await _row(args, model, c, clip, args.turns))
                if client is not None:
                    after = await scrape_server_counters(client)
                    rows[-1].update(row_server_stats(before, after, rows[-1]["duration_s"], served=False))
                _print_row(rows[-1])
    return rows


def _print_row(row: dict) -> None:
    def f(key: str) -> str:
        return "-" if row.get(key) is None else f"{row[key]:.0f}"

    print(f"realtime {row['clip']} sessions={row['concurrency']}: {row['num_turns']} turns, "
          f"{row['failed']} failed, speech end -> VAD {f('mean_speech_end_to_vad_ms')} ms, "
          f"VAD -> audio {f('mean_vad_to_first_audio_ms')} ms (p90 {f('p90_vad_to_first_audio_ms')}), "
          f"barge-in -> silence {f('mean_barge_in_to_silence_ms')} ms",
          file=sys.stderr)
