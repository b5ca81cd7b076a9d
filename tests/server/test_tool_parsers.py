"""tool_choice "auto": a model's own tool calls (Hermes', Llama 3's) read back out of its text, whole or streamed; and
over HTTP on a server whose chat template teaches the format (in-process app, tiny random model: the calls are
forced with a regex, as a model trained on the format would write them)."""

from __future__ import annotations

import json

import pytest

from jaxinfer.server.tool_parsers import Hermes, Llama3Json, parser_for
from tests.server.conftest import in_process, sse_chunks
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
    assert Hermes.parse(text) == (content, calls)


@pytest.mark.parametrize(
    "text, calls",
    [
        ('{"name": "get_time", "parameters": {"zone": "UTC"}}', [("get_time", '{"zone": "UTC"}')]),
        ('  <|python_tag|>{"name": "f", "arguments": {"x": 1}}; {"name": "g", "parameters": {}}\n',
         [("f", '{"x": 1}'), ("g", "{}")]),
        ('{"name": "f"}', [("f", "{}")]),
        ("The answer is 4.", []),
        ('{"x": 1}', []),
        ('{"name": "f", "parameters": {"x": 1}', []),
        ('{"name": "f"} and some words', []),
    ],
    ids=["one call", "two calls after the tag", "no parameters", "text", "json that is not a call",
         "cut short", "words after"],
)  # fmt: skip
def test_llama3_calls_are_the_whole_answer(text, calls):
    assert Llama3Json.parse(text) == ((None, calls) if calls else (text, []))


def test_streamed_content_stops_at_a_call_wherever_the_text_is_cut():
    """Fed the text a character more at a time, what may go out as content is the text before the first call
    exactly: never a piece of the marker, never anything after it; text that only looks like the marker's start
    goes out once the next character shows it is not."""
    text = "Sure <tools> are <tool_ca fine.\n" + CALL_A + " trailing"
    sent = 0
    for end in range(len(text) + 1):
        cut = Hermes.sendable(text[:end])
        assert sent <= cut <= end and Hermes.START not in text[:cut]
        sent = cut
    assert text[:sent] == text[: text.find(Hermes.START)]
    assert Hermes.sendable("no call <tool") == len("no call ") and Hermes.sendable("a <b") == len("a <b")
    # Llama 3: nothing while the answer may still be a call, all of it once it cannot.
    call = '{"name": "get_time", "parameters": {}}'
    assert [Llama3Json.sendable(call[:end]) for end in range(len(call) + 1)] == [0] * (len(call) + 1)
    assert [Llama3Json.sendable(t) for t in ("", "  ", "<|py", "<|python_tag|>{", " It is", "It")] == [0, 0, 0, 0, 6, 2]


def test_the_parser_comes_from_the_chat_template_unless_named():
    assert parser_for("auto", "{{ '<tool_call>' }}") == "hermes"
    assert parser_for("auto", "{%- if tools %}{{- '<|python_tag|>' }}{% endif %}") == "llama3_json"
    assert parser_for("auto", "{{ messages }}") is None and parser_for("auto", None) is None
    assert parser_for("hermes", None) == "hermes" and parser_for("none", "<tool_call>") is None


# ---------------------------------------------------------------------------------------------- over HTTP


def _template(teaching: str) -> str:
    return (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if tools %}<|im_start|>system\n" + teaching + ": {% for t in tools %}{{ t.function.name }} {% endfor %}"
        "<|im_end|>\n{% endif %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


ZONE = r"\{\"zone\": \"(UTC|CET)\"\}"
# Per format: a template that teaches it; what a model that learnt it writes (the regex stands in for its training);
# the content that goes with the call.
FORMATS = {
    "hermes": (_template("Call tools as <tool_call>JSON</tool_call>"),
               r"Checking\. <tool_call>\{\"name\": \"get_time\", \"arguments\": " + ZONE + r"\}</tool_call>",
               "Checking."),
    "llama3_json": (_template("Answer with a JSON call (after <|python_tag|> if you like)"),
                    r"\{\"name\": \"get_time\", \"parameters\": " + ZONE + r"\}", None),
}  # fmt: skip
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module", params=list(FORMATS))
def client(request, tmp_path_factory):
    from jaxinfer import LLM

    path = tmp_path_factory.mktemp("tiny-tools") / "ck"
    write_tiny_model(path)
    template, forced, content = FORMATS[request.param]
    llm = LLM(str(path), chat_template=template, **SETTINGS)
    try:
        with in_process(llm.engine, llm.tokenizer) as c:
            yield c, {"structured_outputs": {"regex": forced}}, content
    finally:
        llm.close()


def _body(**extra) -> dict:
    return {"messages": [{"role": "user", "content": "Time?"}], "max_tokens": 60, "temperature": 0, "tools": TOOLS,
            **extra}  # fmt: skip


def test_auto_returns_the_calls_a_model_writes_and_the_text_before(client):
    """No tool_choice (OpenAI's default "auto"), on a template that teaches a format: the calls come back as
    tool_calls with finish_reason "tool_calls" and the text before them (Hermes) as the content, whole or
    streamed; no piece of a call is ever sent as content."""
    client, forced, content = client
    r = client.post("/v1/chat/completions", json=_body(**forced))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    msg = choice["message"]
    assert choice["finish_reason"] == "tool_calls" and msg["content"] == content, choice
    (call,) = msg["tool_calls"]
    assert call["function"]["name"] == "get_time"
    assert json.loads(call["function"]["arguments"])["zone"] in ("UTC", "CET")
    chunks = sse_chunks(client, "/v1/chat/completions", _body(**forced))
    deltas = [(c["delta"], c["finish_reason"]) for chunk in chunks for c in chunk["choices"]]
    streamed = "".join(d.get("content") or "" for d, _ in deltas)
    calls = [c for d, _ in deltas for c in d.get("tool_calls", [])]
    assert streamed.strip() == (content or "") and "<tool" not in streamed and "{" not in streamed
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        (call["function"]["name"], call["function"]["arguments"])]  # fmt: skip
    assert deltas[-1][1] == "tool_calls"


def test_auto_without_a_call_is_plain_text(client):
    client = client[0]
    r = client.post("/v1/chat/completions", json=_body(tool_choice="auto", max_tokens=5))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert "tool_calls" not in choice["message"] and isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] == "length"


def test_tokenize_renders_the_tools_as_a_chat_request_does(client):
    """/tokenize with messages and tools (vLLM's) gives the prompt a chat request with those tools is given."""
    client = client[0]
    body = {"messages": [{"role": "user", "content": "Time?"}], "tools": TOOLS}
    ids = client.post("/tokenize", json=body).json()["tokens"]
    chat = client.post("/v1/chat/completions", json={**body, "max_tokens": 1, "tool_choice": "none"}).json()
    assert len(ids) == chat["usage"]["prompt_tokens"]
    without = client.post("/tokenize", json={"messages": body["messages"]}).json()["tokens"]
    assert len(ids) > len(without)
    r = client.post("/tokenize", json={"prompt": "x", "tools": TOOLS})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
