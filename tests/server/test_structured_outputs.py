"""Constrained output over HTTP (the shared SmolLM2 server: its engine core in a process of its own): OpenAI's
response_format, vLLM's structured_outputs and its older guided_* fields, on both endpoints, streaming or not, with
n > 1; and tool calls (tool_choice "required" or a named function), which are constrained output too.
"""

from __future__ import annotations

import json
import re

import pytest

from tests.server.conftest import MODEL, sse_chunks

SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}, "tag": {"enum": ["red", "blue"]}},
    "required": ["id", "tag"],
    "additionalProperties": False,
}
MSGS = [{"role": "user", "content": "A record, please."}]


def _check_record(text: str) -> None:
    value = json.loads(text)
    assert set(value) == {"id", "tag"} and 0 <= value["id"] <= 999 and value["tag"] in ("red", "blue"), text


def test_chat_json_schema_and_json_object(http):
    """response_format json_schema gives JSON that follows the schema, for each of n samples; json_object any JSON
    object."""
    schema = {"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA}}
    body = {"model": MODEL, "messages": MSGS, "max_tokens": 60, "temperature": 1.0, "seed": 1, "n": 3,
            "response_format": schema}  # fmt: skip
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        assert choice["finish_reason"] == "stop", choice
        _check_record(choice["message"]["content"])
    body = {"model": MODEL, "messages": MSGS, "max_tokens": 30, "temperature": 0, "response_format": {
        "type": "json_object"}, "structured_outputs": None}  # fmt: skip
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    text = choice["message"]["content"]
    assert text.lstrip().startswith("{"), text
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(text), dict)
    r = http.post("/v1/chat/completions", json={**body, "response_format": {"type": "text"}})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "fields, pattern",
    [
        ({"structured_outputs": {"regex": r"[a-f]{2}-\d{2}"}}, r"[a-f]{2}-\d{2}"),
        ({"structured_outputs": {"choice": ["alpha", "beta gamma"]}}, r"alpha|beta gamma"),
        ({"structured_outputs": {"grammar": 'root ::= "<" ("x" | "yz"){1,3} ">"'}}, r"<(x|yz){1,3}>"),
        ({"guided_choice": ["up", "down"]}, r"up|down"),
        ({"guided_regex": r"\d{4}"}, r"\d{4}"),
        ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}}, r"\{\S*\}"),
        ({"guided_json": json.dumps(SCHEMA)}, r"\{.*\}"),
    ],
    ids=["regex", "choice", "gbnf", "guided_choice", "guided_regex", "json", "guided_json"],
)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_completions_follow_each_kind(http, fields, pattern, stream):
    """Every way of asking, on /v1/completions, streamed or not: each of n = 2 samples is a word of the language."""
    body = {"model": MODEL, "prompt": "Answer:", "max_tokens": 40, "temperature": 1.0, "seed": 5, "n": 2,
            "stream": stream, **fields}  # fmt: skip
    texts, reasons = ["", ""], [None, None]
    if stream:
        for chunk in sse_chunks(http, "/v1/completions", body):
            for c in chunk["choices"]:
                texts[c["index"]] += c["text"]
                reasons[c["index"]] = c["finish_reason"] or reasons[c["index"]]
    else:
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        for c in r.json()["choices"]:
            texts[c["index"]], reasons[c["index"]] = c["text"], c["finish_reason"]
    for text, reason in zip(texts, reasons, strict=True):
        assert reason == "stop" and re.fullmatch(pattern, text, re.DOTALL), (text, reason)
        if "json" in str(fields):
            _check_record(text)


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}  # fmt: skip


def _check_call(call: dict) -> dict:
    """A tool call in OpenAI's shape whose arguments follow its function's schema; returns the arguments."""
    assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-"), call
    args = json.loads(call["function"]["arguments"])
    if call["function"]["name"] == "get_weather":
        assert set(args) == {"city", "unit"} and args["unit"] in ("C", "F") and len(args["city"]) <= 20, args
    else:
        assert call["function"]["name"] == "get_time" and args in ({"zone": "UTC"}, {"zone": "CET"}), call
    return args


def _stream_chat(http, body: dict) -> list[tuple[dict, str | None]]:
    """Each streamed choice's (delta, finish_reason)."""
    chunks = sse_chunks(http, "/v1/chat/completions", body)
    return [(c["delta"], c["finish_reason"]) for chunk in chunks for c in chunk["choices"]]


def test_a_named_function_is_called_with_arguments_that_follow_its_schema(http):
    """tool_choice naming a function: the message holds one call of it (content null), streamed or not; streamed,
    the id and name come with the first arguments, which add up to the same call."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris?"}], "max_tokens": 60,
            "temperature": 0, "tools": [WEATHER, TIME],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}  # fmt: skip
    r = http.post("/v1/chat/completions", json={**body, "n": 2, "temperature": 1.0, "seed": 4})
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        msg = choice["message"]
        assert choice["finish_reason"] == "stop" and msg["content"] is None and len(msg["tool_calls"]) == 1, choice
        _check_call(msg["tool_calls"][0])
    whole = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["tool_calls"][0]
    calls = [d["tool_calls"] for d, _ in _stream_chat(http, body) if d.get("tool_calls")]
    assert calls[0][0]["function"]["name"] == "get_weather" and calls[0][0]["id"].startswith("chatcmpl-tool-")
    assert all("id" not in c[0] and c[0]["index"] == 0 for c in calls[1:])
    assert "".join(c[0]["function"]["arguments"] for c in calls) == whole["function"]["arguments"]


@pytest.mark.parametrize("parallel", [False, True])
def test_required_calls_one_or_more_of_the_tools(http, parallel):
    """tool_choice "required": one call or more, each of one of the tools with arguments of its schema; one only
    with parallel_tool_calls false (with it true, a sample may list calls until max_tokens: its complete ones
    stand). Streamed, each call comes as its object closes, the same calls as the whole response's."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Weather and time?"}], "max_tokens": 120,
            "temperature": 1.0, "seed": 2, "n": 3, "tools": [WEATHER, TIME], "tool_choice": "required",
            "parallel_tool_calls": parallel}  # fmt: skip
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    names = set()
    for choice in r.json()["choices"]:
        msg = choice["message"]
        calls = msg.get("tool_calls")
        if parallel and choice["finish_reason"] == "length":  # calls without end: the complete ones stand
            assert calls or msg["content"].startswith("["), choice
        else:
            assert choice["finish_reason"] == "stop" and calls and (parallel or len(calls) == 1), choice
        calls = calls or []
        names |= {c["function"]["name"] for c in calls}
        for c in calls:
            _check_call(c)
    assert names and names <= {"get_weather", "get_time"}
    first = r.json()["choices"][0]  # sample 0 of a seed is what n = 1 of it gives
    deltas = _stream_chat(http, {**body, "n": 1})
    streamed = [c for d, _ in deltas for c in d.get("tool_calls", [])]
    assert [c["index"] for c in streamed] == list(range(len(streamed)))
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in streamed] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in first["message"].get("tool_calls") or []
    ]
    assert deltas[-1][1] == first["finish_reason"]
    if streamed:  # a call goes out when its object closes, before the array's end and EOS
        assert any(d.get("tool_calls") and reason is None for d, reason in deltas), deltas


def test_a_conversation_with_tool_calls_and_results_goes_on(http):
    """An assistant message that called a tool (content null) and the tool's result reach the chat template; with
    tool_choice "none" the answer is text."""
    arguments = '{"city": "Paris", "unit": "C"}'
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 degrees"}]  # fmt: skip
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 5,
                                                "tools": [WEATHER], "tool_choice": "none"})  # fmt: skip
    assert r.status_code == 200, r.text
    msg = r.json()["choices"][0]["message"]
    assert isinstance(msg["content"], str) and "tool_calls" not in msg
    tokens = http.post("/tokenize", json={"model": MODEL, "messages": messages}).json()["tokens"]
    plain = http.post("/tokenize", json={"model": MODEL, "messages": messages[:1]}).json()["tokens"]
    assert len(tokens) > len(plain) + 5  # the tool's result is in the prompt
