"""Constrained output over HTTP (the shared server: its engine core in a process of its own): OpenAI's
response_format, vLLM's structured_outputs and its older guided_* fields, on both endpoints, streaming or not, with
n > 1. The tiny random model's own choices are noise: every output is in the language only through the grammar."""

from __future__ import annotations

import json
import re

import pytest

from tests.server.conftest import MODEL

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
        with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    for c in json.loads(line[6:])["choices"]:
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
