"""Tool calls on /v1/chat/completions, as vLLM serves them. tool_choice "required" or a named function constrains the
output (structured outputs) to JSON the server turns into the message's tool_calls, with any model:

- named function: the output is the function's arguments, an object that follows its `parameters` schema;
- "required": a JSON array of {"name", "parameters"} objects, one of the tools each (at most one with
  parallel_tool_calls false);
- "none": the tools reach the chat template (as every choice does) and the model answers in text;
- "auto", OpenAI's default with tools: the model answers or calls tools in its own format, which a parser reads
  back (tool_parsers.py: the format its chat template teaches, or --tool-call-parser); a model without one is a
  400 that says what works instead (vLLM answers the same without --enable-auto-tool-choice).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from jaxinfer.engine.grammar import grammar_text
from jaxinfer.server import tool_parsers
from jaxinfer.server.errors import bad_request
from jaxinfer.server.protocol import ChatCompletionRequest
from jaxinfer.server.structured import client_error
from jaxinfer.types import StructuredOutputsParams


@dataclass(frozen=True)
class ToolChoice:
    """What a request's tools ask of the output: `constraint` for the engine ("required", a named function),
    `function` for a named choice, `parser` for "auto" (the format the model's calls are read back from)."""

    constraint: StructuredOutputsParams | None
    function: str | None = None  # the named function
    parser: str | None = None  # "auto": tool_parsers' format name


def tool_choice(req: ChatCompletionRequest, parser: str | None) -> ToolChoice | None:
    """The request's tool choice (None: the answer is text); `parser`: the model's tool-call format, if any. 400s
    name the field."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools to choose from", "tool_choice")
        return None
    if choice is None or choice == "auto":
        if parser is None:
            raise bad_request('tool_choice "auto" (the default when tools are given) needs a parser of the model\'s '
                              "tool-call format, and this model's chat template teaches none this server knows "
                              "(--tool-call-parser names one): send tool_choice \"required\", "
                              '{"type": "function", "function": {"name": ...}} or "none"', "tool_choice",
                              "unsupported_parameter")  # fmt: skip
        return ToolChoice(None, parser=parser)
    if choice == "none":
        return None
    functions = [t.function for t in req.tools]
    names = [f.name for f in functions]
    if len(set(names)) < len(names):
        raise bad_request("tools: each function needs a name of its own", "tools")
    schemas = [f.parameters if f.parameters is not None else {"type": "object"} for f in functions]
    for i, schema in enumerate(schemas):
        try:
            grammar_text(StructuredOutputsParams(json=schema))
        except ValueError as e:
            where = f"tools.{i}.function.parameters"
            raise client_error(e, where, where) from None
    if choice == "required":
        one_of = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
                   "required": ["name", "parameters"], "additionalProperties": False}
                  for name, schema in zip(names, schemas, strict=True)]  # fmt: skip
        calls: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": one_of}}
        if not req.parallel_tool_calls:
            calls["maxItems"] = 1
        return ToolChoice(StructuredOutputsParams(json=calls))
    name = choice.function.name
    if name not in names:
        raise bad_request(f"tool_choice.function.name: {name!r} is not one of the tools' functions",
                          "tool_choice.function.name")  # fmt: skip
    return ToolChoice(StructuredOutputsParams(json=schemas[names.index(name)]), function=name)


def tool_call(name: str, arguments: str) -> dict:
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
            "function": {"name": name, "arguments": arguments}}  # fmt: skip


def tool_calls(choice: ToolChoice, text: str) -> tuple[str | None, list[dict] | None]:
    """(content, tool_calls) of a message whose output is `text`. tool_calls None: there are none (text that is not
    a whole call, e.g. cut short by max_tokens, is the content)."""
    if choice.parser is not None:
        content, calls = tool_parsers.PARSERS[choice.parser].parse(text)
        return content, [tool_call(name, arguments) for name, arguments in calls] or None
    return (None, calls) if (calls := _constrained_calls(choice, text)) is not None else (text, None)


def _constrained_calls(choice: ToolChoice, text: str) -> list[dict] | None:
    if choice.function is not None:
        return [tool_call(choice.function, text)] if _is_json(text) else None
    return [tool_call(name, arguments) for name, arguments in required_calls(text)] or None


def required_calls(text: str) -> tool_parsers.Calls:
    """The whole calls of a "required" output so far, as (name, arguments JSON): the array's complete items (the
    grammar makes each one a call), so a stream can send each as it closes and a cut-short array keeps them."""
    start = len(text) - len(text.lstrip().removeprefix("[").lstrip())
    return [tool_parsers.call_of(item, "parameters") for item, _ in tool_parsers.json_values(text, start, ",")]


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def history_message(msg: dict, tool_calls_in: list | None, tool_call_id: str | None) -> dict:
    """A history message as templates read it: an assistant's tool calls with their arguments as objects (what
    transformers' templates expect; vLLM converts them the same way), a tool message's call id."""
    if tool_calls_in:
        msg["tool_calls"] = [
            {"id": c.id, "type": c.type, "function": {"name": c.function.name,
                                                      "arguments": _arguments(c.function.arguments)}}
            for c in tool_calls_in
        ]  # fmt: skip
    if tool_call_id is not None:
        msg["tool_call_id"] = tool_call_id
    return msg


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text  # written by hand, not JSON: the template gets it as it is
