"""The event loop beside busy Python threads: a uvicorn WebSocket echo (in a process with K threads running
Python DUTY of the time, stand-ins for the stage workers) and 32 clients (another process) each sending a 20 ms
base64 append every 20 ms for S seconds; prints the clients' round trip, for uvicorn's WebSocket protocol
("uvicorn") or the server's (server/websocket.py: "ours"), with permessage-deflate on or off.

    python scripts/ws_lag.py uvicorn 1 1 8 0.9    # protocol, deflate, K, S, DUTY (the shipped server: ours 0)

WS_LOOP=uvloop: uvicorn on uvloop (default: asyncio's, the server's; uvloop halves the busy threads' steps).
"""

from __future__ import annotations

import asyncio
import base64
import json
import multiprocessing as mp
import os
import socket
import sys
import threading
import time

import numpy as np
from fastapi import FastAPI, WebSocket

from omnistage.bench.speech import speech_clip

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from vad_lag import busy

SESSIONS, APPEND = 32, 480  # 20 ms at 24 kHz


def serve(port: int, protocol: str, deflate: bool, k: int, duty: float, steps) -> None:
    import uvicorn

    from omnistage.server.websocket import WebSocketProtocol

    app = FastAPI()

    @app.websocket("/ws")
    async def echo(ws: WebSocket) -> None:
        await ws.accept()
        while (message := await ws.receive())["type"] != "websocket.disconnect":
            event = json.loads(message["text"])
            base64.b64decode(event["audio"])
            await ws.send_text(json.dumps({"type": "ack", "t": event["t"]}))

    stop = threading.Event()
    for _ in range(k):
        threading.Thread(target=busy, args=(duty, stop, steps), daemon=True).start()
    ws = WebSocketProtocol if protocol == "ours" else "websockets-sansio"
    uvicorn.run(app, host="127.0.0.1", port=port, ws=ws, ws_per_message_deflate=deflate, log_level="warning",
                loop=os.environ.get("WS_LOOP", "asyncio"))


async def clients(port: int, seconds: float) -> list[float]:
    from websockets.asyncio.client import connect

    audio = base64.b64encode(speech_clip("question_2s")[:APPEND].tobytes()).decode()
    trips: list[float] = []

    async def one() -> None:
        async with connect(f"ws://127.0.0.1:{port}/ws") as ws:
            async def receive() -> None:
                async for message in ws:
                    trips.append(time.perf_counter() - json.loads(message)["t"])
            receiver = asyncio.create_task(receive())
            t0 = time.perf_counter()
            for i in range(int(seconds * 24000 / APPEND)):
                event = {"type": "input_audio_buffer.append", "audio": audio, "t": time.perf_counter()}
                await ws.send(json.dumps(event))
                await asyncio.sleep(max(0.0, t0 + (i + 1) * APPEND / 24000 - time.perf_counter()))
            await asyncio.sleep(1.0)
            receiver.cancel()

    await asyncio.gather(*(one() for _ in range(SESSIONS)))
    return trips


if __name__ == "__main__":
    protocol, deflate, k, s, duty = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3]), *map(float, sys.argv[4:6])
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    steps = mp.Value("q", 0)
    server = mp.Process(target=serve, args=(port, protocol, deflate, k, duty, steps), daemon=True)
    server.start()
    time.sleep(3)
    n0 = steps.value
    time.sleep(2)
    alone = (steps.value - n0) / 2 / max(k, 1)
    t0, n0 = time.perf_counter(), steps.value
    trips = np.array(asyncio.run(clients(port, s))) * 1e3
    rate = (steps.value - n0) / (time.perf_counter() - t0) / max(k, 1)
    server.kill()
    print(f"{protocol}, deflate {int(deflate)}, {k} threads at {duty:.0%}: {trips.size} round trips, mean "
          f"{trips.mean():.1f} ms, p90 {np.percentile(trips, 90):.1f}, max {trips.max():.0f}; "
          f"{rate:.1f} steps/s a thread ({alone:.1f} before the clients came)")
