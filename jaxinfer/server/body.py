"""Request body -> validated pydantic model, with every failure as a 400/413 in OpenAI's shape.

Parsed by hand rather than by FastAPI's body binding so that the size bound, UTF-8 decoding, JSON syntax and
field errors each get their own clear message (FastAPI would answer 422 in its own shape).
"""

from __future__ import annotations

import json
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from jaxinfer.server.errors import APIError, bad_request

M = TypeVar("M", bound=BaseModel)

# Past the bound the rest of an oversized body is still read (and dropped), up to this factor, so a client that
# sends it whole gets its 413 instead of a reset connection; beyond that the connection is cut.
_DRAIN_FACTOR = 16


async def read_body(request: Request, limit: int) -> bytes:
    too_large = APIError(413, f"request body exceeds {limit} bytes", code="request_too_large")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit * _DRAIN_FACTOR:
        raise too_large
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit * _DRAIN_FACTOR:
            break
        if size <= limit:
            chunks.append(chunk)
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
        return json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise bad_request(f"request body is not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})") from None
    except ValueError as e:
        raise bad_request(f"request body is not valid JSON: {e}") from None
    except RecursionError:
        raise bad_request("request body is nested too deeply") from None


def _loc(loc: tuple) -> str:
    # Pydantic adds the union member it tried (e.g. "str", "list[int]") to the location; the client only cares
    # about the field path.
    parts = [str(p) for p in loc if isinstance(p, int) or not any(c in str(p) for c in "[]") and p not in _TYPE_NAMES]
    return ".".join(parts)


_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none", "function-after", "function-plain"}


def validation_error(e: ValidationError) -> APIError:
    errors = e.errors()
    err = errors[0]
    param = _loc(err["loc"]) or None
    if err["type"] == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {param}", param, "unknown_parameter")
    if err["type"] == "missing":
        return bad_request(f"missing required parameter: {param}", param)
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


async def parse_request(request: Request, model: type[M], limit: int, off_loop=None) -> M:
    """The body as `model`; with `off_loop` (ServingContext.off_loop) JSON and model validation run on a thread."""
    raw = await read_body(request, limit)
    if off_loop is None:
        return parse_body(raw, model)
    return await off_loop(parse_body, raw, model)
