"""Server CPU of idle realtime sessions: N sessions stream silence in APPEND_MS appends to a running server;
prints the CPU seconds per wall second of the server process and of each of its child processes (a pipeline's
worker with `placement: pipeline`; Linux /proc).

usage: python scripts/realtime_idle_cost.py ws://127.0.0.1:8091 SERVER_PID [N] [APPEND_MS]"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import sys
import time

import websockets


def cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def processes(pid: int) -> list[int]:
    """The server and its children (started by any of its threads)."""
    tasks = os.listdir(f"/proc/{pid}/task")
    return [pid, *(int(c) for t in tasks for c in open(f"/proc/{pid}/task/{t}/children").read().split())]


async def session(url: str, append_ms: int, stop: asyncio.Event) -> None:
    async with websockets.connect(url + "/v1/realtime", max_size=None) as ws:
        await ws.send(json.dumps({"type": "session.update", "session": {"type": "realtime"}}))
        audio = base64.b64encode(bytes(2 * 24 * append_ms)).decode()
        message = json.dumps({"type": "input_audio_buffer.append", "audio": audio})
        drain = asyncio.create_task(_drain(ws))
        due = time.perf_counter()
        while not stop.is_set():
            await ws.send(message)
            due += append_ms / 1e3
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
        drain.cancel()


async def _drain(ws) -> None:
    async for _ in ws:
        pass


async def main(url: str, pid: int, n: int, append_ms: int) -> None:
    stop = asyncio.Event()
    tasks = [asyncio.create_task(session(url, append_ms, stop)) for _ in range(n)]
    await asyncio.sleep(3)
    pids = processes(pid)
    c0, t0 = [cpu_seconds(p) for p in pids], time.perf_counter()
    await asyncio.sleep(10)
    c1, t1 = [cpu_seconds(p) for p in pids], time.perf_counter()
    stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    cores = [(b - a) / (t1 - t0) for a, b in zip(c0, c1)]
    children = "".join(f", child {p} {c:.2f}" for p, c in zip(pids[1:], cores[1:]))
    print(f"server CPU: {cores[0]:.2f} cores{children} for {n} idle sessions at {append_ms} ms appends")


if __name__ == "__main__":
    a = sys.argv[1:]
    asyncio.run(main(a[0], int(a[1]), int(a[2]) if len(a) > 2 else 64, int(a[3]) if len(a) > 3 else 20))
