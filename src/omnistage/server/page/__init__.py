"""GET /: a page to talk to the model in a browser (index.html, app.js, turns.js, attach.js, worklets.js:
plain JavaScript, no build step). It opens /v1/realtime, streams the microphone as 24 kHz pcm16, plays the
answer gapless and shows both sides' transcripts, the last turn's timings (the page's and the server's) and
an image attached for the next turn; its API key rides in a WebSocket subprotocol (subprotocol.py)."""

from __future__ import annotations

from importlib.resources import files

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, Response
from starlette.exceptions import HTTPException

from omnistage.server.page.subprotocol import install_subprotocol_auth

PAGE = files(__package__).joinpath("index.html").read_text("utf-8")
SCRIPTS = {name: files(__package__).joinpath(name).read_text("utf-8")
           for name in ("app.js", "turns.js", "attach.js", "worklets.js")}


def install_page(app: FastAPI) -> None:
    install_subprotocol_auth(app)

    @app.get("/", include_in_schema=False)
    async def page() -> HTMLResponse:
        return HTMLResponse(PAGE)

    @app.get("/page/{name}", include_in_schema=False)
    async def script(name: str) -> Response:
        if name not in SCRIPTS:
            raise HTTPException(404)  # the app's handler answers OpenAI's "Invalid URL (GET ...)"
        return Response(SCRIPTS[name], media_type="text/javascript")
