"""tool_choice "auto": the tool calls a model writes in its own format, read back out of its text.

Two formats are known, under vLLM's names for its parsers:
- "hermes" (Qwen 2.5 and 3, Hermes 2 Pro and later): each call a JSON object {"name": ..., "arguments": {...}}
  between <tool_call> and </tool_call>, after whatever the model says first;
- "llama3_json" (Llama 3.1, 3.2 and 3.3): the whole answer is the call, {"name": ..., "parameters": {...}}, or
  several separated by ";" (after <|python_tag|> where the text keeps special tokens).
A chat template that teaches one (`Parser.taught_by`) picks it, so such a model answers tool_choice "auto" with no
flag (vLLM needs two); --tool-call-parser names one for a template that does not say.

Text that is not a well-formed call stays the message's content: a model that starts a call and writes no valid
JSON gets its text back, not an error.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

Calls = list[tuple[str, str]]  # each call's (name, arguments as JSON text)


def json_values(text: str, pos: int, separator: str) -> Iterator[tuple[object, int]]:
    """The JSON values written one after another in `text` from `pos`, `separator` and whitespace between them,
    each with the position it ends at; it stops at the first that does not decode (cut short, or not JSON)."""
    decoder = json.JSONDecoder()
    while pos < len(text):
        try:
            value, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return
        yield value, pos
        pos = len(text) - len(text[pos:].lstrip().removeprefix(separator).lstrip())


def call_of(obj: object, arguments_key: str) -> tuple[str, str] | None:
    """A decoded call object as (name, arguments JSON), or None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    other = "parameters" if arguments_key == "arguments" else "arguments"
    arguments = obj.get(arguments_key, obj.get(other, {}))
    return obj["name"], arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


class Hermes:
    START, END = "<tool_call>", "</tool_call>"
    _CALL = re.compile(re.escape(START) + r"(.*?)(?:" + re.escape(END) + r"|$)", re.DOTALL)

    @staticmethod
    def taught_by(template: str) -> bool:
        return Hermes.START in template

    @staticmethod
    def parse(text: str) -> tuple[str | None, Calls]:
        """(content, calls): the text before the first call (None when blank), and the calls; no calls, or one that
        is not a JSON object with a string name: (text, [])."""
        first = text.find(Hermes.START)
        if first < 0:
            return text, []
        calls = []
        for body in Hermes._CALL.findall(text, first):
            try:
                call = call_of(json.loads(body), "arguments")
            except ValueError:
                return text, []
            if call is None:
                return text, []
            calls.append(call)
        return text[:first].strip() or None, calls

    @staticmethod
    def sendable(text: str) -> int:
        """How much of a stream's text so far may go out as content: all of it up to a call's marker, less a tail
        that may be the start of one ("<tool" at the end), which waits for what comes next."""
        first = text.find(Hermes.START)
        if first >= 0:
            return first
        for keep in range(min(len(Hermes.START) - 1, len(text)), 0, -1):
            if Hermes.START.startswith(text[-keep:]):
                return len(text) - keep
        return len(text)


class Llama3Json:
    TAG = "<|python_tag|>"

    @staticmethod
    def taught_by(template: str) -> bool:
        return Llama3Json.TAG in template or '"parameters": dictionary of argument name' in template

    @staticmethod
    def parse(text: str) -> tuple[str | None, Calls]:
        """(None, calls) when the whole answer is one call or several separated by ";"; else (text, [])."""
        body = text.strip().removeprefix(Llama3Json.TAG).lstrip()
        if not body.startswith("{"):
            return text, []
        values = list(json_values(body, 0, ";"))
        calls = [call_of(obj, "parameters") for obj, _ in values]
        after = body[values[-1][1] :].strip().removeprefix(";").strip() if values else body
        if not calls or None in calls or after:  # not JSON, not a call, cut short, or words after
            return text, []
        return None, calls

    @staticmethod
    def sendable(text: str) -> int:
        """Nothing while the answer may be a call (it starts with "{", or has not started yet); all of it once it
        cannot be."""
        start = text.lstrip()
        if not start or start.startswith(("{", Llama3Json.TAG)) or Llama3Json.TAG.startswith(start):
            return 0
        return len(text)


PARSERS = {"hermes": Hermes, "llama3_json": Llama3Json}


def parser_for(choice: str, chat_template: str | None) -> str | None:
    """The parser --tool-call-parser names ("auto": the one the chat template teaches); None: none."""
    if choice == "auto":
        return next((name for name, p in PARSERS.items() if chat_template and p.taught_by(chat_template)), None)
    return None if choice == "none" else choice
