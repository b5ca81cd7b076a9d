"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}, for every failure the server returns."""

from __future__ import annotations

import json
import logging
import re
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",  # OpenAI's
    503: "service_unavailable",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 err_type: str | None = None, headers: dict[str, str] | None = None):  # fmt: skip
        """err_type: the `type` field when not the status's usual one (OpenAI's rate limits say "requests" or
        "tokens"); headers: sent with the error (Retry-After, x-ratelimit-*)."""
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.err_type, self.headers = err_type, dict(headers or {})

    def body(self) -> dict:
        err_type = self.err_type or _TYPES.get(
            self.status, "invalid_request_error" if self.status < 500 else "server_error"
        )
        return {"error": {"message": self.message, "type": err_type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer", **self.headers} if self.status == 401 else self.headers
        return _ErrorResponse(self.body(), status_code=self.status, headers=headers or None)


class _ErrorResponse(JSONResponse):
    """An error's JSON in ASCII (\\u escapes): a message that quotes the client's input (a model name, a stop
    string) must render whatever that input holds, a lone surrogate included, which UTF-8 cannot encode."""

    def render(self, content: object) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


# SamplingParams and Engine.validate start their messages with the field's name ("temperature must be >= 0",
# "max_tokens: prompt ... exceeds"); the name becomes `param`.
_LEADING_NAME = re.compile(r"^([a-z_]+)[: ]")


def from_value_error(e: ValueError, renames: dict[str, str] | None = None) -> APIError:
    message = str(e)
    m = _LEADING_NAME.match(message)
    param = m.group(1) if m else None
    if renames:  # the client's names for the fields (max_completion_tokens, ...), wherever the message names them
        param = renames.get(param, param)
        message = re.sub(r"\b(" + "|".join(map(re.escape, renames)) + r")\b", lambda w: renames[w[1]], message)
    return bad_request(message, param)


def install_handlers(app: FastAPI, on_error=None) -> None:
    """Every error leaves as OpenAI's shape: our own, routing's (404/405) and unexpected ones (500).
    `on_error(request, error)` sees each (metrics, the access log)."""

    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        if on_error is not None:
            on_error(request, exc)
        return exc.response()

    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        phrase = HTTPStatus(exc.status_code).phrase if exc.status_code in HTTPStatus._value2member_map_ else ""
        message = exc.detail if isinstance(exc.detail, str) else phrase
        return await api_error(request, APIError(exc.status_code, message))

    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return await api_error(request, APIError(500, f"internal error: {type(exc).__name__}"))

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)
