"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}, with the fitting HTTP status."""

from __future__ import annotations

import logging
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
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(message, 400, "invalid_request_error", param, code)


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
    """Every /v1 route needs `Authorization: Bearer <api_key>` (no check when api_key is None)."""
    if api_key is not None:
        app.add_middleware(_APIKeyMiddleware, expected=f"Bearer {api_key}".encode())


class _APIKeyMiddleware:
    def __init__(self, app: ASGIApp, expected: bytes) -> None:
        self.app, self.expected = app, expected

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            got = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(got, self.expected):
                error = OpenAIError("Incorrect API key provided.", 401, code="invalid_api_key")
                return await error.response()(scope, receive, send)
        await self.app(scope, receive, send)


async def _on_openai_error(request: Request, exc: Any) -> JSONResponse:
    return exc.response()


async def _on_validation_error(request: Request, exc: Any) -> JSONResponse:
    return validation_error(list(exc.errors())).response()


async def _on_http_error(request: Request, exc: Any) -> JSONResponse:
    if exc.status_code == 404:
        message, code = f"Invalid URL ({request.method} {request.url.path})", "unknown_url"
    else:
        message, code = str(exc.detail), None
    return OpenAIError(message, exc.status_code, "invalid_request_error", code=code).response()


async def _on_internal_error(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("internal error on %s %s", request.method, request.url.path)
    message = "The server had an error while processing your request."
    return OpenAIError(message, 500, "server_error").response()
