"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}, with the fitting HTTP status;
the API key and body-size checks; messages scrubbed of the server's file paths."""

from __future__ import annotations

import logging
import re
import secrets
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

logger = logging.getLogger(__name__)

# NOTE: pydantic puts a tagged union's tag into `loc` after the list index ("content", 0, "image_url", ...).
_TAGGED_LISTS = ("content",)


class OpenAIError(Exception):
    """Raise anywhere in request handling (pydantic validators too: it is not a ValueError, so pydantic
    lets it through) to answer with this error."""

    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(message, 400, "invalid_request_error", param, code)


def overloaded(message: str, retry_after: int) -> OpenAIError:
    return OpenAIError(message, 429, "rate_limit_error", code="rate_limit_exceeded",
                       headers={"Retry-After": str(retry_after)})


def unavailable(message: str) -> OpenAIError:
    return OpenAIError(message, 503, "server_error", code="engine_unavailable")


# NOTE: an absolute path of two or more parts that is not inside a URL ("file:///x/y" is left as sent).
_PATH = re.compile(r"(?<![\w:/.~-])/(?:[\w.@+~-]+/)+[\w.@+~-]*")


def public_message(message: str) -> str:
    """`message` without the server's file paths, for an error a client sees."""
    return _PATH.sub("<path>", message)


def model_not_found(model: str) -> OpenAIError:
    return OpenAIError(f"The model `{model}` does not exist.", 404, "invalid_request_error", "model",
                       "model_not_found")


def param_from_loc(loc: tuple) -> str | None:
    """("body", "messages", 0, "content", 1, "image_url", "image_url", "url")
    -> "messages[0].content[1].image_url.url" (union branch names and tags dropped)."""
    out: list[str] = []
    for i, item in enumerate(loc):
        if isinstance(item, int):
            out.append(f"[{item}]")
        elif i == 0 and item == "body" or "[" in item:
            continue
        elif i >= 2 and isinstance(loc[i - 1], int) and loc[i - 2] in _TAGGED_LISTS:
            continue
        else:
            out.append(f".{item}" if out else item)
    return "".join(out) or None


def validation_error(errors: list[dict]) -> OpenAIError:
    """The most specific (deepest) pydantic error as a 400."""
    err = max(errors, key=lambda e: len(e["loc"]))
    param = param_from_loc(tuple(err["loc"]))
    if err["type"] == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {param}", param)
    if err["type"] == "json_invalid":
        return bad_request("We could not parse the JSON body of your request.")
    message = err["msg"].removeprefix("Value error, ")
    return bad_request(f"{param}: {message}" if param else message, param)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(OpenAIError, _on_openai_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(HTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_internal_error)


def install_api_key(app: FastAPI, api_key: str | None) -> None:
    """Every /v1 route needs `Authorization: Bearer <api_key>` (no check when api_key is None); a WebSocket
    (/v1/realtime) without it is refused at the handshake with the same 401."""
    if api_key:
        app.add_middleware(_APIKeyMiddleware, expected=api_key.encode())


def install_body_limit(app: FastAPI, max_bytes: int) -> None:
    """Request bodies over `max_bytes` get a 413, whether they say their length or not."""
    app.add_middleware(_BodyLimitMiddleware, max_bytes=max_bytes)


class _APIKeyMiddleware:
    def __init__(self, app: ASGIApp, expected: bytes) -> None:
        self.app, self.expected = app, expected

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket") and scope["path"].startswith("/v1"):
            scheme, _, token = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
            # NOTE: compare_digest takes the same time wherever the first wrong byte is.
            if not (secrets.compare_digest(token.strip(), self.expected) and scheme.lower() == b"bearer"):
                error = OpenAIError("Incorrect API key provided.", 401, code="invalid_api_key")
                return await error.response()(scope, receive, send)
        await self.app(scope, receive, send)


class _BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"0")
        if not length.isdigit() or int(length) > self.max_bytes:
            return await self._too_large().response()(scope, receive, send)
        seen = 0

        async def counted() -> dict:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:  # NOTE: FastAPI lets an HTTPException out of body parsing as it is
                raise HTTPException(413, self._too_large().message)
            return message

        await self.app(scope, counted, send)

    def _too_large(self) -> OpenAIError:
        return OpenAIError(f"The request body is larger than this server's limit of {self.max_bytes} bytes.",
                           413, code="request_too_large")


async def _on_openai_error(request: Request, exc: Any) -> JSONResponse:
    return exc.response()


async def _on_validation_error(request: Request, exc: Any) -> JSONResponse:
    return validation_error(list(exc.errors())).response()


async def _on_http_error(request: Request, exc: Any) -> JSONResponse:
    if exc.status_code == 404:
        message, code = f"Invalid URL ({request.method} {request.url.path})", "unknown_url"
    else:
        message, code = str(exc.detail), "request_too_large" if exc.status_code == 413 else None
    return OpenAIError(message, exc.status_code, "invalid_request_error", code=code).response()


async def _on_internal_error(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("internal error on %s %s", request.method, request.url.path)
    message = "The server had an error while processing your request."
    return OpenAIError(message, 500, "server_error").response()
