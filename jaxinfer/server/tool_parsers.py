"""tool_choice "auto": the tool calls a model writes in its own format, read back out of its text.

One format is known, Hermes' (Qwen 2.5 and 3, Hermes 2 Pro and later, and the models trained on their templates):
each call is a JSON object {"name": ..., "arguments": {...}} between <tool_call> and </tool_call>, after whatever
the model says first. vLLM calls this parser "hermes". A template that writes "<tool_call>" is taken to teach it
(`parser_for`), so such a model answers tool_choice "auto" with no flag.

Text that is not a well-formed call stays the message's content: a model that writes the marker and then no valid
JSON gets its text back, not an error.
"""

from __future__ import annotations

import json
import re

START, END = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(START) + r"(.*?)(?:" + re.escape(END) + r"|$)", re.DOTALL)


def parser_for(choice: str, chat_template: str | None) -> str | None:
    """The parser --tool-call-parser names ("auto": hermes where the chat template writes its marker); None: none."""
    if choice == "auto":
        return "hermes" if chat_template and START in chat_template else None
    return None if choice == "none" else choice


def parse(text: str) -> tuple[str | None, list[tuple[str, str]]]:
    """(content, calls) of a whole output: the text before the first call (None when blank), and each call's
    (name, arguments as JSON text). No calls, or one that is not a JSON object with a string name: (text, [])."""
    first = text.find(START)
    if first < 0:
        return text, []
    calls = []
    for body in _CALL.findall(text, first):
        try:
            call = json.loads(body)
        except ValueError:
            return text, []
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return text, []
        arguments = call.get("arguments", call.get("parameters", {}))
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        calls.append((call["name"], arguments))
    content = text[:first].strip()
    return content or None, calls


def sendable(text: str) -> int:
    """How much of a stream's text so far may go out as content: all of it up to a call's marker, less a tail that
    may be the start of one ("<tool" at the end), which waits for what comes next."""
    first = text.find(START)
    if first >= 0:
        return first
    for keep in range(min(len(START) - 1, len(text)), 0, -1):
        if START.startswith(text[-keep:]):
            return len(text) - keep
    return len(text)
