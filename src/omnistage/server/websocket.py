"""The server's WebSocket protocol for uvicorn: its own (websockets, sans-I/O), except that reading pauses only
once HIGH_WATER client messages wait for the app, not after every message.

uvicorn pauses reading after each message and resumes at the app's next receive: two epoll_ctl calls per
message, each giving the GIL up. Beside the stage threads running Python, taking it back waits out the switch
interval, so 32 realtime sessions appending every 20 ms slowed the event loop for every session. The client
still cannot run ahead: past HIGH_WATER queued messages reading pauses, until the app has taken them all.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

HIGH_WATER = 16  # client messages queued for the app before reading pauses


class _Transport:
    """The socket's transport without uvicorn's per-message pause_reading / resume_reading (the protocol below
    pauses the socket's own)."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self.socket = transport

    def __getattr__(self, name: str) -> Any:
        return getattr(self.socket, name)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


class WebSocketProtocol(WebSocketsSansIOProtocol):
    _paused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(_Transport(transport))  # type: ignore[arg-type]

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if not self._paused and self.queue.qsize() >= HIGH_WATER:
            self._paused = True
            self.transport.socket.pause_reading()

    async def receive(self) -> Any:
        message = await super().receive()
        if self.queue.empty():
            self._resume()
        return message

    async def send(self, message: Any) -> None:
        await super().send(message)
        if message["type"] == "websocket.close":  # NOTE: the client's closing frame must be read
            self._resume()

    def _resume(self) -> None:
        if self._paused:
            self._paused = False
            self.transport.socket.resume_reading()
