"""Bad requests get the right status and an OpenAI-shaped error naming the parameter; the server keeps serving."""

from __future__ import annotations

import json

import pytest

from tests.server.conftest import MODEL

OK = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
MSGS = [{"role": "user", "content": "Hi"}]


def _completion(**overrides) -> bytes:
    return json.dumps({**OK, **overrides}).encode()


def _chat(**overrides) -> bytes:
    return json.dumps({"messages": MSGS, **overrides}).encode()


C, CHAT = "/v1/completions", "/v1/chat/completions"
IMAGE = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
TOOLS = [{"type": "function", "function": {"name": "f"}}]

# (name, path, raw body, status, param)
CASES = [
    ("malformed json", C, b'{"prompt": "hi",', 400, None),
    ("json array", C, b'["hi"]', 400, None),
    ("empty body", C, b"", 400, None),
    ("NaN", C, b'{"prompt": "hi", "temperature": NaN}', 400, None),
    ("invalid utf-8", C, b'{"prompt": "\xff\xfe\xfa"}', 400, None),
    ("missing prompt", C, json.dumps({"model": MODEL}).encode(), 400, "prompt"),
    ("max_tokens as string", C, _completion(max_tokens="8"), 400, "max_tokens"),
    ("prompt as number", C, _completion(prompt=5), 400, "prompt"),
    ("n as float", C, _completion(n=1.5), 400, "n"),
    ("stream as string", C, _completion(stream="yes"), 400, "stream"),
    ("temperature < 0", C, _completion(temperature=-0.5), 400, "temperature"),
    ("top_p = 0", C, _completion(top_p=0), 400, "top_p"),
    ("top_p > 1", C, _completion(top_p=1.5), 400, "top_p"),
    ("n < 1", C, _completion(n=0), 400, "n"),
    ("max_tokens = 0", C, _completion(max_tokens=0), 400, "max_tokens"),
    ("max_tokens < 0", C, _completion(max_tokens=-3), 400, "max_tokens"),
    ("max_tokens over context", C, _completion(max_tokens=100_000), 400, "max_tokens"),
    ("empty prompt", C, _completion(prompt=""), 400, "prompt"),
    ("empty prompt list", C, _completion(prompt=[]), 400, "prompt"),
    ("empty prompt in list", C, _completion(prompt=["a", ""]), 400, "prompt"),
    ("prompt over context", C, _completion(prompt="hello " * 700), 400, "prompt"),
    ("token id out of vocab", C, _completion(prompt=[1, 10_000_000]), 400, "prompt"),
    ("logprobs over max", C, _completion(logprobs=21), 400, "logprobs"),
    ("logprobs negative", C, _completion(logprobs=-1), 400, "logprobs"),
    ("chat: top_logprobs negative", CHAT, _chat(logprobs=True, top_logprobs=-1), 400, "top_logprobs"),
    ("bad logit_bias key", C, _completion(logit_bias={"abc": 1}), 400, "logit_bias"),
    ("logit_bias id out of vocab", C, _completion(logit_bias={"99999999": 1}), 400, "logit_bias"),
    ("seed past 64 bits", C, _completion(seed=2**64), 400, "seed"),  # -1 and other int64 seeds are valid (OpenAI)
    ("empty stop string", C, _completion(stop=[""]), 400, "stop"),
    ("stream_options without stream", C, _completion(stream_options={"include_usage": True}), 400, "stream_options"),
    ("unknown parameter", C, _completion(frobnicate=1), 400, "frobnicate"),
    ("unknown stream option", C, _completion(stream=True, stream_options={"x": 1}), 400, "stream_options.x"),
    ("best_of", C, _completion(best_of=3), 400, "best_of"),
    ("suffix", C, _completion(suffix="end"), 400, "suffix"),
    # prompt_logprobs are served (tests/server/test_prompt_logprobs.py), but not in a stream (as vLLM).
    ("prompt_logprobs with stream", C, _completion(prompt_logprobs=1, stream=True), 400, "prompt_logprobs"),
    ("chat: prompt_logprobs with stream", CHAT, _chat(prompt_logprobs=0, stream=True), 400, "prompt_logprobs"),
    ("prompt_logprobs over max", C, _completion(prompt_logprobs=21), 400, "prompt_logprobs"),
    ("prompt_logprobs negative", C, _completion(prompt_logprobs=-1), 400, "prompt_logprobs"),
    ("prompt_logprobs as bool", CHAT, _chat(prompt_logprobs=True), 400, "prompt_logprobs"),
    ("allowed_token_ids empty", C, _completion(allowed_token_ids=[]), 400, "allowed_token_ids"),
    ("allowed_token_ids out of vocab", CHAT, _chat(allowed_token_ids=[1, 10_000_000]), 400, "allowed_token_ids"),
    ("allowed_token_ids as strings", C, _completion(allowed_token_ids=["a"]), 400, "allowed_token_ids.0"),
    ("bad_words blank", C, _completion(bad_words=["ok", " "]), 400, "bad_words"),
    ("use_beam_search", C, _completion(use_beam_search=True), 400, "use_beam_search"),
    ("priority", CHAT, _chat(priority=2), 400, "priority"),
    ("bad_words too many", CHAT, _chat(bad_words=[f"w{i}" for i in range(40)]), 400, "bad_words"),
    ("bad_words as ids", C, _completion(bad_words=[5]), 400, "bad_words.0"),
    # echo with logprobs is served (tests/server/test_echo_logprobs.py); over the maximum it is still a 400.
    ("echo with logprobs over max", C, _completion(echo=True, logprobs=21), 400, "logprobs"),
    ("chat: no messages", CHAT, _chat(messages=[]), 400, "messages"),
    ("chat: bad role", CHAT, _chat(messages=[{"role": "robot", "content": "x"}]), 400, "messages.0.role"),
    ("chat: max_completion_tokens = 0", CHAT, _chat(max_completion_tokens=0), 400, "max_completion_tokens"),
    # Tools with tool_choice "required" or named are served (tests/server/test_structured_outputs.py); "auto", the
    # default with tools, needs a tool-call parser.
    ("chat: tools", CHAT, _chat(tools=TOOLS), 400, "tool_choice"),
    ("chat: tool_choice auto", CHAT, _chat(tools=TOOLS, tool_choice="auto"), 400, "tool_choice"),
    ("chat: tool_choice without tools", CHAT, _chat(tool_choice="required"), 400, "tool_choice"),
    (
        "chat: unknown function",
        CHAT,
        _chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "g"}}),
        400,
        "tool_choice.function.name",
    ),
    (
        "chat: tool parameters invalid",
        CHAT,
        _chat(
            tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
            tool_choice="required",
        ),
        400,
        "tools.0.function.parameters",
    ),
    ("chat: two functions of one name", CHAT, _chat(tools=TOOLS * 2, tool_choice="required"), 400, "tools"),
    (
        "chat: tool name with a space",
        CHAT,
        _chat(tools=[{"type": "function", "function": {"name": "a b"}}], tool_choice="required"),
        400,
        "tools.0.function.name",
    ),
    (
        "chat: tools beside response_format",
        CHAT,
        _chat(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}),
        400,
        "response_format",
    ),
    # Structured outputs are served (tests/server/test_structured_outputs.py); what cannot compile is a 400 naming
    # the field the client wrote.
    ("response_format unknown type", CHAT, _chat(response_format={"type": "xml"}), 400, "response_format.type"),
    (
        "json_schema without it",
        CHAT,
        _chat(response_format={"type": "json_schema"}),
        400,
        "response_format.json_schema",
    ),
    (
        "json_schema without schema",
        CHAT,
        _chat(response_format={"type": "json_schema", "json_schema": {"name": "a"}}),
        400,
        "response_format.json_schema.schema",
    ),
    (
        "json_schema bad name",
        CHAT,
        _chat(response_format={"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}),
        400,
        "response_format.json_schema.name",
    ),
    (
        "json_schema invalid",
        CHAT,
        _chat(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "nope"}}}),
        400,
        "response_format.json_schema.schema",
    ),
    ("guided_regex invalid", C, _completion(guided_regex="a["), 400, "guided_regex"),
    ("guided_choice empty", C, _completion(guided_choice=[]), 400, "guided_choice"),
    (
        "structured_outputs grammar invalid",
        C,
        _completion(structured_outputs={"grammar": "start: ("}),
        400,
        "structured_outputs.grammar",
    ),
    (
        "structured_outputs two kinds",
        C,
        _completion(structured_outputs={"regex": "a", "choice": ["b"]}),
        400,
        "structured_outputs",
    ),
    (
        "structured_outputs unknown field",
        C,
        _completion(structured_outputs={"backend": "xgrammar"}),
        400,
        "structured_outputs.backend",
    ),
    (
        "two constraints",
        CHAT,
        _chat(response_format={"type": "json_object"}, guided_choice=["a"]),
        400,
        "guided_choice",
    ),
    ("chat: top_logprobs without logprobs", CHAT, _chat(top_logprobs=2), 400, "top_logprobs"),
    ("chat: image part", CHAT, _chat(messages=IMAGE), 400, "messages.0.content"),
    ("unknown model", C, _completion(model="gpt-17"), 404, "model"),
    ("unknown model (chat)", CHAT, _chat(model="gpt-17"), 404, "model"),
    ("detokenize out of vocab", "/detokenize", json.dumps({"tokens": [-1]}).encode(), 400, "tokens"),
    (
        "tokenize: a prompt with add_generation_prompt",
        "/tokenize",
        json.dumps({"prompt": "x", "add_generation_prompt": False}).encode(),
        400,
        "add_generation_prompt",
    ),
    # JSON escapes may spell half of a UTF-16 pair: no UTF-8 encoder takes it (tokenizer, engine, response).
    ("lone surrogate in prompt", C, b'{"prompt": "a\\ud800b", "max_tokens": 2}', 400, "prompt"),
    ("lone surrogate in stop", C, b'{"prompt": "a", "stop": ["x", "\\udfff"], "stream": true}', 400, "stop.1"),
    ("lone surrogate in model", C, b'{"prompt": "a", "model": "\\ud800"}', 400, "model"),
    (
        "lone surrogate in a message",
        CHAT,
        b'{"messages": [{"role": "user", "content": "\\ud83d"}]}',
        400,
        "messages.0.content",
    ),  # fmt: skip
    ("prompt of mixed types", C, _completion(prompt=[1, "a"]), 400, "prompt"),
    (
        "unknown field of a content part",
        CHAT,
        _chat(messages=[{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {}}]}]),
        400,
        "messages.0.content.0.cache_control",
    ),  # fmt: skip
    (
        "text part without text",
        CHAT,
        _chat(messages=[{"role": "user", "content": [{"type": "text"}]}]),
        400,
        "messages.0.content",
    ),  # fmt: skip
    (
        "chat: a function's result",
        CHAT,
        _chat(messages=[*MSGS, {"role": "function", "content": "42", "name": "f"}]),
        400,
        "messages.1.role",
    ),  # fmt: skip
    ("chat: a user message without content", CHAT, _chat(messages=[{"role": "user"}]), 400, "messages.0.content"),
    (
        "chat: a refusal part",
        CHAT,
        _chat(messages=[*MSGS, {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]}]),
        400,
        "messages.1.content",
    ),  # fmt: skip
    ("metadata over 16 pairs", CHAT, _chat(metadata={str(i): "v" for i in range(17)}), 400, "metadata"),
    ("metadata not text", CHAT, _chat(metadata={"a": 1}), 400, "metadata.a"),
    (
        "chat: min_tokens over max_completion_tokens",
        CHAT,
        _chat(min_tokens=10, max_completion_tokens=3),
        400,
        "min_tokens",
    ),  # fmt: skip
    (
        "chat: tool calls in history",
        CHAT,
        _chat(messages=[*MSGS, {"role": "assistant", "content": "x", "tool_calls": [{"id": "1"}]}]),
        400,
        "messages.1.tool_calls.0.function",
    ),  # fmt: skip
]


def _check_error(r, status: int, param: str | None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


@pytest.mark.parametrize(("name", "path", "body", "status", "param"), CASES, ids=[c[0] for c in CASES])
def test_bad_request(http, name, path, body, status, param):
    r = http.post(path, content=body, headers={"Content-Type": "application/json"})
    err = _check_error(r, status, param)
    if name in ("best_of", "suffix", "use_beam_search", "priority", "chat: image part", "chat: a function's result",
                "chat: a refusal part"):  # fmt: skip
        assert "not supported" in err["message"]
    if name in ("chat: tools", "chat: tool_choice auto"):
        assert '"auto"' in err["message"] and "required" in err["message"], err
    if "negative" in name:  # the bound is the server's max_logprobs, not the int32 range it was said as
        assert ">= 0" in err["message"] and "2147483647" not in err["message"], err
    if name == "chat: a function's result":
        assert "'tool' message" in err["message"], err
    if name == "chat: min_tokens over max_completion_tokens":  # the client's name, also inside the message
        assert "max_completion_tokens (3)" in err["message"] and "max_tokens (" not in err["message"], err
    if name.startswith("lone surrogate"):
        assert "surrogate" in err["message"]
    if name == "prompt of mixed types":
        assert "list[int]" in err["message"] and "list[str]" in err["message"], err
    if name == "text part without text":
        assert "needs its 'text'" in err["message"], err


def test_null_means_not_set(http):
    """OpenAI reads null as "not set" for its optional fields; clients that write every field send it. Where null
    means something of its own it keeps it: completions' max_tokens null is the rest of the context."""
    base = {**OK, "max_tokens": 3}
    want = http.post("/v1/completions", json=base).json()["choices"][0]["text"]
    nulls = {"n": None, "stream": None, "echo": None, "logprobs": None, "stop": None, "seed": None, "user": None}
    r = http.post("/v1/completions", json={**base, **nulls})
    assert r.status_code == 200, r.text
    assert [c["text"] for c in r.json()["choices"]] == [want]
    history = [*MSGS, {"role": "assistant", "content": "Hello", "tool_calls": None, "refusal": None},
               {"role": "user", "content": "Bye", "name": None}]  # fmt: skip
    chat = {"messages": history, "max_tokens": 2, "n": None, "logprobs": None, "stream": None, "tools": None}
    r = http.post("/v1/chat/completions", json=chat)
    assert r.status_code == 200 and len(r.json()["choices"]) == 1, r.text
    # A null is "not set", not a pass for a field the request does not have.
    _check_error(http.post("/v1/chat/completions", json={**chat, "tool_calls": None}), 400, "tool_calls")
    # metadata tags a stored completion and this server stores none: accepted on both endpoints, output unchanged.
    r = http.post("/v1/completions", json={**base, "metadata": {"run": "qa", "step": "1"}})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want, r.text
    r = http.post("/v1/chat/completions", json={**chat, "metadata": {}})
    assert r.status_code == 200, r.text
    # vLLM's beam search and priority fields at their "off" values (clients that send every field): same output.
    off = {"use_beam_search": False, "length_penalty": 1.0, "priority": 0}
    r = http.post("/v1/completions", json={**base, **off})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want, r.text


def test_models_version_and_cors(http):
    name = http.get("/v1/models").json()["data"][0]["id"]
    r = http.get(f"/v1/models/{name}")
    assert r.status_code == 200 and r.json()["id"] == name
    _check_error(http.get("/v1/models/gpt-17"), 404, "model")
    assert http.get("/version").json()["version"]
    assert http.head("/health").status_code == http.head("/version").status_code == 200  # probes that send HEAD
    # A browser's preflight and the CORS header on the answer (vLLM's default: any origin).
    pre = http.options("/v1/chat/completions", headers={"Origin": "http://localhost:3000",
                                                        "Access-Control-Request-Method": "POST"})  # fmt: skip
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] in ("*", "http://localhost:3000")
    r = http.post("/v1/completions", json=OK, headers={"Origin": "http://localhost:3000"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"


def test_oversized_body(http):
    body = json.dumps({**OK, "prompt": "x" * (5 * 2**20)}).encode()
    _check_error(http.post("/v1/completions", content=body), 413, None)


def test_unknown_route_and_method(http):
    _check_error(http.get("/v1/nothing-here"), 404, None)
    _check_error(http.get("/v1/completions"), 405, None)


def test_still_serving_after_errors(http):
    for _ in range(2):
        http.post("/v1/completions", content=b"{oops")
        r = http.post("/v1/completions", json=OK)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    assert http.get("/health").status_code == 200
    metrics = http.get("/metrics").text
    assert 'jaxinfer:http_errors_total{status="400"}' in metrics


def test_a_client_gone_mid_body_is_a_499_not_a_server_error(server, http):
    """A client that closes the connection halfway through its body: counted as nginx's 499 (client closed
    request), never as a 500 with a traceback that would page whoever alerts on the server's error rate."""
    import re
    import socket
    import time
    from urllib.parse import urlsplit

    def count(status: str) -> float:
        m = re.search(rf'^jaxinfer:http_errors_total{{status="{status}"}} (\S+)$', http.get("/metrics").text, re.M)
        return float(m.group(1)) if m else 0.0

    before = count("500"), count("499")
    url = urlsplit(server.url)
    auth = "".join(f"{k}: {v}\r\n" for k, v in server.headers.items())
    for _ in range(2):
        with socket.create_connection((url.hostname, url.port)) as sock:
            sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\n"
                         'Content-Length: 1000\r\n\r\n{"prompt": "hi"'.encode())  # fmt: skip
            time.sleep(0.2)
    deadline = time.monotonic() + 10
    while count("499") < before[1] + 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert (count("500"), count("499")) == (before[0], before[1] + 2)
    assert "unhandled error" not in server.log_tail(20000)


@pytest.mark.parametrize(
    "model, body",
    [("ChatCompletionRequest", {"model": "m", "messages": [{}] * 200_000}),
     ("CompletionRequest", {"model": "m", "prompt": [[1, "a"]] * 200_000}),
     ("CompletionRequest", {"model": "m", "prompt": "x", "stop_token_ids": [""] * 200_000}),
     ("DetokenizeRequest", {"tokens": [""] * 200_000})],
)  # fmt: skip
def test_a_list_of_bad_items_reports_its_first(model, body):
    """A body of a few MiB whose every list item is wrong: validation stops at each list's first bad item (it
    collected one error per item: 3 GB and 9 s holding the GIL for 1.3M messages), and the 400 names that one."""
    from pydantic import ValidationError

    from jaxinfer.server import protocol
    from jaxinfer.server.body import validation_error

    with pytest.raises(ValidationError) as e:
        getattr(protocol, model).model_validate(body)
    assert e.value.error_count() <= 8
    assert validation_error(e.value).status == 400
