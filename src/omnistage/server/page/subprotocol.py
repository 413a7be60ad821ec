"""A browser's API key on a WebSocket: browsers cannot set an Authorization header there, so OpenAI's browser
clients offer the subprotocols `realtime` and `openai-insecure-api-key.<KEY>`. This middleware turns the
second into `Authorization: Bearer <KEY>` (so the endpoint checks one header, as for the SDK; a header sent
too wins) and answers `realtime` when the endpoint accepts naming no subprotocol (a browser drops such a
handshake)."""

from __future__ import annotations

from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

KEY_PREFIX = "openai-insecure-api-key."
REALTIME = "realtime"


def install_subprotocol_auth(app: FastAPI) -> None:
    app.add_middleware(_SubprotocolAuth)


class _SubprotocolAuth:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "websocket" or not scope.get("subprotocols"):
            return await self.app(scope, receive, send)
        offered = scope["subprotocols"]
        keys = [p[len(KEY_PREFIX):] for p in offered if p.startswith(KEY_PREFIX)]
        headers = list(scope["headers"])
        if keys and not any(name == b"authorization" for name, _ in headers):
            headers.append((b"authorization", f"Bearer {keys[0]}".encode()))
        scope = {**scope, "headers": headers}

        answer = REALTIME in offered

        async def answered(message: Message) -> None:
            if answer and message["type"] == "websocket.accept" and not message.get("subprotocol"):
                message = {**message, "subprotocol": REALTIME}
            await send(message)

        await self.app(scope, receive, answered)
