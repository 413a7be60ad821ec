"""The server's WebSocket protocol (server/websocket.py) in a real uvicorn, beside uvicorn's own: reading pauses
only past HIGH_WATER queued messages (uvicorn's pauses after every one), and an app that does not read still
stops the client (reading pauses, the queue stays bounded), with nothing lost or reordered."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, WebSocket
from serve_process import free_port
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.sync.client import connect

from omnistage.server.websocket import HIGH_WATER, WebSocketProtocol

MESSAGES = 200
SIZE = 20_000  # bytes a message: one socket read (256 KiB at most) brings at most 13
PER_READ = 13


class Socket:
    """A transport counting its pause_reading calls."""

    def __init__(self, transport, protocol: type) -> None:
        self.transport, self.protocol = transport, protocol

    def __getattr__(self, name: str):
        return getattr(self.transport, name)

    def pause_reading(self) -> None:
        self.protocol.pauses += 1
        self.transport.pause_reading()


def counting(base: type) -> type:
    """`base`, counting its socket's pause_reading calls; the last connection's protocol and socket kept."""
    class Counting(base):
        pauses = 0
        last = None

        def connection_made(self, transport):
            type(self).last, self.socket = self, Socket(transport, type(self))
            super().connection_made(self.socket)
    return Counting


def app(gate: threading.Event) -> FastAPI:
    """Echoes each message's first 4 characters; after "hold" it reads nothing until the gate opens, then takes
    MESSAGES messages and answers how many came in order."""
    api = FastAPI()

    @api.websocket("/ws")
    async def echo(ws: WebSocket) -> None:
        await ws.accept()
        while (message := await ws.receive())["type"] != "websocket.disconnect":
            if message["text"] != "hold":
                await ws.send_text(message["text"][:4])
                continue
            while not gate.is_set():
                await asyncio.sleep(0.01)
            got = [(await ws.receive())["text"][:4] for _ in range(MESSAGES)]
            await ws.send_text(str(sum(text == f"{i:04d}" for i, text in enumerate(got))))
    return api


@pytest.fixture(params=[WebSocketProtocol, WebSocketsSansIOProtocol], ids=["ours", "uvicorn"])
def served(request):
    base = request.param
    protocol, gate = counting(base), threading.Event()
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app(gate), host="127.0.0.1", port=port, ws=protocol,
                                           loop="asyncio", ws_per_message_deflate=False, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield f"ws://127.0.0.1:{port}/ws", protocol, gate, base is WebSocketProtocol
    gate.set()
    server.should_exit = True
    thread.join(10)


def test_reading_pauses_past_high_water_only(served):
    url, protocol, gate, ours = served
    with connect(url, max_size=None) as ws:
        for i in range(50):  # an app that keeps up
            ws.send(f"{i:04d}")
            assert ws.recv() == f"{i:04d}"
        assert protocol.pauses == 0 if ours else protocol.pauses >= 50
        ws.send("hold")
        sender = threading.Thread(target=lambda: [ws.send(f"{i:04d}" + "x" * SIZE) for i in range(MESSAGES)])
        sender.start()
        deadline = time.monotonic() + 20
        while protocol.last.socket.is_reading() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # NOTE: nothing more may come in while paused
        assert not protocol.last.socket.is_reading()
        assert protocol.last.queue.qsize() <= (HIGH_WATER if ours else 1) + PER_READ
        gate.set()
        sender.join(20)
        assert ws.recv() == str(MESSAGES)
