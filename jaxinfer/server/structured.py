"""A request's constrained-output fields -> `StructuredOutputsParams`, checked here so that a 400 names the field
the client wrote (response_format.json_schema.schema, structured_outputs.regex, guided_choice, ...)."""

from __future__ import annotations

import dataclasses
import re

from jaxinfer.engine.grammar import grammar_text
from jaxinfer.server.errors import APIError, bad_request
from jaxinfer.server.protocol import SamplingRequest
from jaxinfer.types import StructuredOutputsParams

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def structured_outputs(
    req: SamplingRequest, tools: StructuredOutputsParams | None = None
) -> StructuredOutputsParams | None:
    """The request's one constraint (None: plain text); `tools`: its tool_choice's, checked already. Two ways of
    asking at once, or a schema, regex or grammar that does not compile, is a 400 naming the field."""
    asked: list[tuple[str, dict, str]] = []  # (request field, StructuredOutputsParams fields, where errors point)
    if tools is not None:
        asked.append(("tool_choice", dataclasses.asdict(tools), "tool_choice"))
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        asked.append(("response_format", {"json_object": True}, "response_format"))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None:
            raise bad_request("response_format: type json_schema needs its json_schema", "response_format.json_schema")
        asked.append(("response_format", {"json": rf.json_schema.schema_}, "response_format.json_schema.schema"))
    if req.structured_outputs is not None:
        fields = req.structured_outputs.model_dump(exclude_none=True)
        fields["json"] = fields.pop("json_", None)
        given = [k for k in ("json", "regex", "choice", "grammar", "json_object") if fields.get(k) is not None]
        where = f"structured_outputs.{given[0]}" if len(given) == 1 else "structured_outputs"
        asked.append(("structured_outputs", fields, where))
    for name, kind in _GUIDED.items():
        value = getattr(req, name)
        if value is not None:
            asked.append((name, {kind: value}, name))
    if not asked:
        return None
    if len(asked) > 1:
        names = ", ".join(a[0] for a in asked)
        raise bad_request(f"{asked[1][0]}: one constraint per request, got {names}", asked[1][0])
    name, fields, where = asked[0]
    try:
        so = StructuredOutputsParams(**fields)
        grammar_text(so)
    except ValueError as e:
        raise client_error(e, where, name) from None
    return so


def client_error(e: ValueError, where: str, field: str) -> APIError:
    """A StructuredOutputsParams or grammar error as a 400 in the client's names: a message that names one of its
    fields ("structured_outputs.regex: ...") names `where` instead; any other message names the request's
    `field`."""
    message = str(e)
    named = re.match(r"structured_outputs\.\w+", message)
    if named is None:
        return bad_request(message, field)
    return bad_request(where + message[named.end() :], where)
