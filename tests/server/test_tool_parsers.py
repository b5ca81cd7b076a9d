"""tool_choice "auto": a model's own (Hermes) tool calls read back out of its text, whole or streamed; and over
HTTP on a server whose chat template teaches that format (in-process app, tiny random model: the calls are forced
with a regex, as a model trained on the format would write them)."""

from __future__ import annotations

import json

import pytest

from jaxinfer.server import tool_parsers
from jaxinfer.server.tool_parsers import parse, parser_for, sendable
from tests.server.conftest import in_process
from tests.tiny_model import SETTINGS, write_tiny_model

CALL_A = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
CALL_B = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}\n</tool_call>'


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ("Just text.", "Just text.", []),
        (CALL_A, None, [("get_time", '{"zone": "UTC"}')]),
        ("Let me check.\n" + CALL_A + "\n" + CALL_B, "Let me check.",
         [("get_time", '{"zone": "UTC"}'), ("get_weather", '{"city": "Oslo", "unit": "C"}')]),
        ('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}', None, [("f", '{"x": 1}')]),  # unterminated, str
        ('<tool_call>{"name": "f", "parameters": {"x": 2}}</tool_call>', None, [("f", '{"x": 2}')]),
        ('<tool_call>{"name": "f"}</tool_call>', None, [("f", "{}")]),
        ("Oops <tool_call>{not json}</tool_call>", "Oops <tool_call>{not json}</tool_call>", []),
        ('<tool_call>["f"]</tool_call>', '<tool_call>["f"]</tool_call>', []),
        ('<tool_call>{"name": 3}</tool_call>', '<tool_call>{"name": 3}</tool_call>', []),
    ],
    ids=["text", "call", "content and two calls", "unterminated", "parameters", "no arguments", "bad json",
         "not an object", "name not a string"],
)  # fmt: skip
def test_hermes_calls_are_read_out_of_the_text(text, content, calls):
    assert parse(text) == (content, calls)


def test_streamed_content_stops_at_a_call_wherever_the_text_is_cut():
    """Fed the text a character more at a time, what may go out as content is the text before the first call
    exactly: never a piece of the marker, never anything after it; text that only looks like the marker's start
    goes out once the next character shows it is not."""
    text = "Sure <tools> are <tool_ca fine.\n" + CALL_A + " trailing"
    sent = 0
    for end in range(len(text) + 1):
        cut = sendable(text[:end])
        assert sent <= cut <= end and tool_parsers.START not in text[:cut]
        sent = cut
    assert text[:sent] == text[: text.find(tool_parsers.START)]
    assert sendable("no call <tool") == len("no call ") and sendable("a <b") == len("a <b")


def test_the_parser_comes_from_the_chat_template_unless_named():
    assert parser_for("auto", "{{ '<tool_call>' }}") == "hermes"
    assert parser_for("auto", "{{ messages }}") is None and parser_for("auto", None) is None
    assert parser_for("hermes", None) == "hermes" and parser_for("none", "<tool_call>") is None


# ---------------------------------------------------------------------------------------------- over HTTP

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if tools %}<|im_start|>system\nCall tools as <tool_call>JSON</tool_call>: "
    "{% for t in tools %}{{ t.function.name }} {% endfor %}<|im_end|>\n{% endif %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
# What a model that learnt the format writes: a sentence, then one call. The regex stands in for its training.
FORCED = {"structured_outputs": {"regex": r"Checking\. <tool_call>\{\"name\": \"get_time\", \"arguments\": "
                                          r"\{\"zone\": \"(UTC|CET)\"\}\}</tool_call>"}}  # fmt: skip


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    from jaxinfer import LLM

    path = tmp_path_factory.mktemp("tiny-tools") / "ck"
    write_tiny_model(path)
    llm = LLM(str(path), chat_template=TEMPLATE, **SETTINGS)
    try:
        with in_process(llm.engine, llm.tokenizer) as c:
            yield c
    finally:
        llm.close()


def _body(**extra) -> dict:
    return {"messages": [{"role": "user", "content": "Time?"}], "max_tokens": 60, "temperature": 0, "tools": TOOLS,
            **extra}  # fmt: skip


def test_auto_returns_the_calls_a_model_writes_and_the_text_before(client):
    """No tool_choice (OpenAI's default "auto"), on a template that teaches Hermes' format: the calls come back as
    tool_calls with finish_reason "tool_calls" and the text before them as the content, whole or streamed."""
    r = client.post("/v1/chat/completions", json=_body(**FORCED))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    msg = choice["message"]
    assert choice["finish_reason"] == "tool_calls" and msg["content"] == "Checking.", choice
    (call,) = msg["tool_calls"]
    assert call["function"]["name"] == "get_time" and json.loads(call["function"]["arguments"])["zone"] in (
        "UTC",
        "CET",
    )
    deltas = []
    with client.stream("POST", "/v1/chat/completions", json=_body(stream=True, **FORCED)) as s:
        for line in s.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                deltas += [(c["delta"], c["finish_reason"]) for c in json.loads(line[6:])["choices"]]
    content = "".join(d.get("content") or "" for d, _ in deltas)
    streamed = [c for d, _ in deltas for c in d.get("tool_calls", [])]
    assert content.strip() == "Checking." and "<tool" not in content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in streamed] == [
        (call["function"]["name"], call["function"]["arguments"])]  # fmt: skip
    assert deltas[-1][1] == "tool_calls"


def test_auto_without_a_call_is_plain_text(client):
    r = client.post("/v1/chat/completions", json=_body(tool_choice="auto", max_tokens=5))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert "tool_calls" not in choice["message"] and isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] == "length"
