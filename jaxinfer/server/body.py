"""Request body -> validated pydantic model, with every failure as a 400/413 in OpenAI's shape.

Parsed by hand rather than by FastAPI's body binding so that the size bound, UTF-8 decoding, JSON syntax and
field errors each get their own clear message (FastAPI would answer 422 in its own shape).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request

from jaxinfer.server.errors import APIError, bad_request

M = TypeVar("M", bound=BaseModel)

# How long a request's body may take to arrive (4 MiB at 140 KB/s).
BODY_TIMEOUT_S = 30.0
# Past the bound the rest of an oversized body is still read (and dropped), up to this factor, so a client that
# sends it whole gets its 413 instead of a reset connection; beyond that the connection is cut.
_DRAIN_FACTOR = 16


class BodyReads:
    """The request bodies being read, so that the end of a drain ends them too: each then answers 503
    shutting_down in OpenAI's shape while uvicorn still waits for responses. Cancelled by uvicorn after its grace
    period instead, such a handler's client got uvicorn's plain-text 500. Event-loop side only."""

    def __init__(self) -> None:
        self._reading: set[asyncio.Timeout] = set()
        self.ended = False

    def end(self) -> None:
        """The drain is over: every body still being read (and any read after this) stops now."""
        self.ended = True
        now = asyncio.get_running_loop().time()
        for timeout in self._reading:
            timeout.reschedule(now)

    @contextlib.asynccontextmanager
    async def reading(self, seconds: float) -> AsyncIterator[asyncio.Timeout]:
        async with asyncio.timeout(seconds) as timeout:
            if self.ended:
                timeout.reschedule(asyncio.get_running_loop().time())
            self._reading.add(timeout)
            try:
                yield timeout
            finally:
                self._reading.discard(timeout)


async def read_body(request: Request, limit: int, reads: BodyReads | None = None) -> bytes:
    too_large = APIError(413, f"request body exceeds {limit} bytes", code="request_too_large")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit * _DRAIN_FACTOR:
        raise too_large
    chunks: list[bytes] = []
    size = 0
    reads = reads if reads is not None else BodyReads()
    try:
        async with reads.reading(BODY_TIMEOUT_S):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit * _DRAIN_FACTOR:
                    break
                if size <= limit:
                    chunks.append(chunk)
    except TimeoutError:
        if reads.ended:
            raise APIError(503, "the server shut down before the request body arrived", code="shutting_down") from None
        # A body sent a few bytes at a time (slowloris) holds its memory and connection no longer.
        raise APIError(408, f"the request body did not arrive within {BODY_TIMEOUT_S:g}s",
                       code="request_timeout") from None  # fmt: skip
    except ClientDisconnect:  # gone mid-body: nginx's 499 in the access log and metrics, not a server error
        raise APIError(499, "the client closed the connection before sending the whole body",
                       code="client_disconnected") from None  # fmt: skip
    if size > limit:
        raise too_large
    return b"".join(chunks)


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


def parse_json(raw: bytes) -> object:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(f"request body is not valid UTF-8: {e.reason} at byte {e.start}") from None
    if not text.strip():
        raise bad_request("request body is empty; expected a JSON object")
    try:
        # parse_constant: Python's json would otherwise accept NaN and Infinity, which JSON does not have.
        data = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise bad_request(f"request body is not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})") from None
    except ValueError as e:
        raise bad_request(f"request body is not valid JSON: {e}") from None
    except RecursionError:
        raise bad_request("request body is nested too deeply") from None
    if _SURROGATE_ESCAPE.search(text):  # only an escape can put one in: the text itself decoded as UTF-8
        _reject_lone_surrogates(data, [])
    return data


# JSON's \uXXXX escapes may spell half of a UTF-16 pair (a client that cut a string inside an emoji). Python's json
# keeps the lone half as a surrogate code point, which no UTF-8 encoder takes: the tokenizer, the engine's messages
# and the response would each fail on it (a 500, or a stream cut short).
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _reject_lone_surrogates(value: object, path: list) -> None:
    """400 naming the first string (or key) that holds a lone surrogate; a valid pair decodes to one code point."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            param = ".".join(map(str, path)) or None
            where = f"{param}: " if param else ""
            raise bad_request(f"{where}text holds a lone UTF-16 surrogate (half of a \\uXXXX pair); it is not "
                              "valid Unicode", param) from None  # fmt: skip
    elif isinstance(value, dict):
        for key, item in value.items():
            _reject_lone_surrogates(key, path)
            _reject_lone_surrogates(item, [*path, key])
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _reject_lone_surrogates(item, [*path, i])


def _loc(loc: tuple) -> str:
    # Pydantic adds the union member it tried (e.g. "str", "list[int]") to the location; the client only cares
    # about the field path.
    parts = [str(p) for p in loc if isinstance(p, int) or not any(c in str(p) for c in "[]") and p not in _TYPE_NAMES]
    return ".".join(parts)


_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none", "function-after", "function-plain"}


def _union_member(loc: tuple) -> int | None:
    """The index in `loc` of the union member pydantic tried (a type name such as "str" or "list[int]"), if any."""
    return next((i for i, p in enumerate(loc) if isinstance(p, str) and ("[" in p or p in _TYPE_NAMES)), None)


def validation_error(e: ValidationError) -> APIError:
    errors = e.errors(include_url=False, include_input=False)
    # An unknown field is the most specific thing to say, even where a union tried another member first (a content
    # part with a field we do not know also fails to be a string).
    err = next((x for x in errors if x["type"] == "extra_forbidden"), errors[0])
    param = _loc(err["loc"]) or None
    if err["type"] == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {param}", param, "unknown_parameter")
    if err["type"] == "missing":
        return bad_request(f"missing required parameter: {param}", param)
    # A value no member of its field's union took (prompt: [1, "a"]) reports one error per member, each about a
    # different part of it: name the field and its accepted types rather than the first member's complaint.
    at = _union_member(err["loc"])
    if at is not None:
        field = err["loc"][:at]
        members = list(dict.fromkeys(x["loc"][at] for x in errors if x["loc"][:at] == field and len(x["loc"]) > at))
        if len(members) > 1:
            param = _loc(field) or None
            return bad_request(f"{param}: expected one of the accepted types ({', '.join(members)})", param)
    # A field with several accepted types reports one error per type; say them together.
    same = list(dict.fromkeys(x["msg"] for x in errors if (_loc(x["loc"]) or None) == param))
    detail = same[0] if len(same) == 1 else "expected one of the accepted types (" + "; ".join(same) + ")"
    return bad_request(f"{param}: {detail}", param)


def parse_body(raw: bytes, model: type[M]) -> M:
    data = parse_json(raw)
    if not isinstance(data, dict):
        raise bad_request(f"request body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None


async def parse_request(request: Request, model: type[M], limit: int, off_loop=None,
                        reads: BodyReads | None = None) -> M:  # fmt: skip
    """The body as `model`; with `off_loop` (ServingContext.off_loop) JSON and model validation run on a thread.
    `reads`: the server's (ServerState.body_reads), which a drain's end stops."""
    raw = await read_body(request, limit, reads)
    if off_loop is None:
        return parse_body(raw, model)
    return await off_loop(parse_body, raw, model)
