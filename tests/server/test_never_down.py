"""Never down, against a real `python serve.py` (engine core in its own process, tiny random-weight model):
validation at the engine's real limits and the fan-out caps, one request failing inside the engine while 20
stream on, echo with max_tokens 0, no compilation at serving time, and a hypothesis fuzzer over request bodies
interleaved with valid streams, after which the KV pool is whole again.

One server serves every test here. The fuzzer's short profile runs in CI; the long one is a command:

    JAXINFER_FUZZ_EXAMPLES=2000 PYTHONPATH=$PWD python -m pytest -q tests/server/test_never_down.py -k fuzz
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxinfer.engine.engine import FAULT_REQUEST_ENV
from tests.server.test_engine_process import _body, _start, _stream, tiny_model  # noqa: F401 - fixture

FAIL_ID = "fail-me"
FUZZ_EXAMPLES = int(os.environ.get("JAXINFER_FUZZ_EXAMPLES", "60"))
PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time", "1, 2, 3, 4,"]


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):  # noqa: F811
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(FAULT_REQUEST_ENV, FAIL_ID)  # the engine fails the request whose X-Request-Id is FAIL_ID
        # The logprobs cap stays the default (20): a raised one compiles other steps (tests/server/test_echo_logprobs.py
        # proves the flag); these limits are the API's own.
        srv = _start(tiny_model, tmp_path_factory.mktemp("never-down") / "server.log",
                     "--max-n", "4", "--max-stop", "3", "--max-prompts", "4")  # fmt: skip
    from tests.server.conftest import wait_ready

    try:
        wait_ready(srv)
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


def _metric(http: httpx.Client, name: str) -> float:
    m = re.search(rf"^jaxinfer:{name} (\S+)$", http.get("/metrics").text, re.M)
    assert m, name
    return float(m.group(1))


def _pool_whole(http: httpx.Client, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    # Pages a session keeps (a `user` field on the shared server) are not held by any request.
    while (
        _metric(http, "kv_cache_used_pages") != _metric(http, "session_pinned_pages")
        or _metric(http, "num_requests_in_flight") != 0
    ):
        assert time.monotonic() < deadline, http.get("/metrics").text
        time.sleep(0.1)


def _greedy(http: httpx.Client, prompt: str, **kw) -> dict:
    r = http.post("/v1/completions", json=_body(prompt, **kw))
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize(
    "body,param",
    [
        ({"n": 5}, "n"),
        ({"stop": ["a", "b", "c", "d"]}, "stop"),
        ({"stop": "x" * 300}, "stop"),
        ({"logprobs": 21}, "logprobs"),
        ({"prompt": ["a", "b", "c", "d", "e"]}, "prompt"),
        ({"max_tokens": 2**31}, "max_tokens"),
        ({"n": 2**40}, "n"),
        ({"stop_token_ids": [2**31]}, "stop_token_ids"),
        ({"logit_bias": {"99999999999": 1}}, "logit_bias"),
        (b'{"prompt": "Hi", "temperature": 1e400}', "temperature"),  # an overflow parses as inf: not finite
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": 2**33}, "min_tokens"),
    ],
)
def test_out_of_range_is_a_400_naming_the_parameter(http, body, param):
    raw = body if isinstance(body, bytes) else json.dumps({**_body("Hi"), **body}).encode()
    r = http.post("/v1/completions", content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param


def test_limits_that_work(http):
    base = _greedy(http, PROMPTS[0])["choices"][0]["text"]
    # A top_k past the vocabulary (and past int32) keeps the whole vocabulary: greedy gives the same text.
    assert _greedy(http, PROMPTS[0], top_k=3_000_000_000)["choices"][0]["text"] == base
    # The cap (--max-logprobs, default 20): that many alternatives come back for each token.
    lp = _greedy(http, PROMPTS[0], logprobs=20)["choices"][0]["logprobs"]
    assert all(len(alts) >= 20 for alts in lp["top_logprobs"])
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                                                 "logprobs": True, "top_logprobs": 20})  # fmt: skip
    assert r.status_code == 200 and len(r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 20


def test_echo_with_max_tokens_0_returns_the_scored_prompt(http):
    r = http.post("/v1/completions", json={"prompt": PROMPTS[2], "max_tokens": 0, "echo": True, "logprobs": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    assert choice["text"] == PROMPTS[2] and body["usage"]["completion_tokens"] == 0
    lp = choice["logprobs"]
    assert lp["token_logprobs"][0] is None and all(isinstance(x, float) for x in lp["token_logprobs"][1:])
    assert "".join(lp["tokens"]) == PROMPTS[2] and len(lp["tokens"]) == body["usage"]["prompt_tokens"]
    # The same scores as echo with a generated token (whose own entry is dropped here).
    full = _greedy(http, PROMPTS[2], max_tokens=1, echo=True, logprobs=2)["choices"][0]["logprobs"]
    assert full["token_logprobs"][: len(lp["tokens"])] == pytest.approx(lp["token_logprobs"], abs=1e-5)


def test_one_failing_request_ends_alone(server, http):
    """The engine fails the request with X-Request-Id FAIL_ID while 20 others stream: they finish with the tokens
    of a clean run, the failed one gets an OpenAI-shaped 500 (non-streaming) or SSE error event (streaming)."""
    bodies = [_body(PROMPTS[i % 4], max_tokens=10 + i % 5) for i in range(20)]

    async def run(with_failure: bool):
        limits = httpx.Limits(max_connections=30)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as c:
            streams = [_stream(c, b) for b in bodies]
            if not with_failure:
                return await asyncio.gather(*streams), None, None
            headers = {"X-Request-Id": FAIL_ID}
            failed_plain = c.post("/v1/completions", json=_body(PROMPTS[0]), headers=headers)

            async def failed_stream():
                async with c.stream("POST", "/v1/completions", json={**_body(PROMPTS[1]), "stream": True},
                                    headers=headers) as r:  # fmt: skip
                    return r.status_code, [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]

            return await asyncio.gather(asyncio.gather(*streams), failed_plain, failed_stream())

    clean, _, _ = asyncio.run(run(False))
    streamed, plain, (status, events) = asyncio.run(run(True))
    assert [(t, r) for t, r, _ in streamed] == [(t, r) for t, r, _ in clean]
    assert plain.status_code == 500, plain.text
    err = plain.json()["error"]
    assert err["code"] == "engine_error" and "injected failure" in err["message"] and err["type"] == "server_error"
    assert status == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "engine_error"
    _pool_whole(http)
    assert http.get("/health").status_code == 200


def test_no_compilation_while_serving(server, http):
    """Every request option on the warmed server, echo + logprobs and logprobs=20 (the cap) included, once the
    variants a cold start left are compiled: the core compiles them while idle."""
    deadline = time.monotonic() + 300
    while _metric(http, "engine_pending_compilations") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _metric(http, "engine_pending_compilations") == 0
    before = _metric(http, "engine_compilations")
    assert before > 0  # the warm-up's
    chat = {"messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 4}
    cases = [
        ("/v1/completions", _body(PROMPTS[0], echo=True, logprobs=5)),
        ("/v1/completions", _body(PROMPTS[1] * 8, echo=True, logprobs=20, max_tokens=3)),  # chunked prefill
        ("/v1/completions", _body(PROMPTS[2], logprobs=20)),
        ("/v1/completions", {"prompt": PROMPTS[3], "max_tokens": 0, "echo": True, "logprobs": 0}),
        ("/v1/completions", _body(PROMPTS[0], temperature=0.8, top_k=5, top_p=0.9, min_p=0.05, seed=1, n=3)),
        (
            "/v1/completions",
            _body(
                PROMPTS[1],
                presence_penalty=1,
                frequency_penalty=0.5,
                repetition_penalty=1.2,
                logit_bias={"5": 3},
                min_tokens=3,
                stop_token_ids=[7],
                stop=["x"],
            ),
        ),  # fmt: skip
        ("/v1/completions", _body(PROMPTS[2], echo=True, logprobs=1, repetition_penalty=1.3)),
        ("/v1/completions", {"prompt": PROMPTS, "max_tokens": 3, "stream": True}),
        ("/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 20}),
        ("/v1/completions", _body(PROMPTS[1], prompt_logprobs=20, logprobs=2, return_tokens_as_token_ids=True)),
        ("/v1/chat/completions", {**chat, "prompt_logprobs": 0, "allowed_token_ids": [5, 6, 7], "temperature": 1.0}),
        ("/v1/completions", _body(PROMPTS[0], bad_words=["Paris", "the city"], n=2, temperature=1.0, seed=3)),
        ("/v1/chat/completions", {**chat, "n": 2, "temperature": 1.0, "stream": True}),
        ("/v1/chat/completions", {**chat, "response_format": {"type": "json_object"}, "temperature": 1.0}),
        ("/v1/completions", _body(PROMPTS[0], guided_choice=["a", "b"], n=2, stream=True)),
        (
            "/v1/chat/completions",
            {
                **chat,
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": "required",
                "stream": True,
            },
        ),
    ]
    for path, body in cases:
        r = http.post(path, json=body)
        assert r.status_code == 200, (body, r.text)
    _pool_whole(http)
    assert _metric(http, "engine_compilations") == before


# ---------------------------------------------------------------------------------------------- the fuzzer

_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.integers(min_value=-3, max_value=40), st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=40), st.sampled_from(["", "\x00", "\ud7ff\U0010ffff", "é" * 300]),
)  # fmt: skip
_json = st.recursive(_scalars, lambda inner: st.one_of(st.lists(inner, max_size=5),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=5)),
                     max_leaves=20)  # fmt: skip
_FIELDS = ["prompt", "max_tokens", "n", "temperature", "top_p", "top_k", "min_p", "stop", "seed", "logprobs",
           "echo", "logit_bias", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens",
           "stop_token_ids", "ignore_eos", "best_of", "stream", "stream_options", "include_stop_str_in_output",
           "skip_special_tokens", "messages", "top_logprobs", "max_completion_tokens", "user", "model",
           "prompt_logprobs", "allowed_token_ids", "return_tokens_as_token_ids", "bad_words", "response_format",
           "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "tools",
           "tool_choice", "parallel_tool_calls"]  # fmt: skip


@st.composite
def _bodies(draw) -> tuple[str, bytes]:
    path = draw(st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
    base: dict = {"prompt": "Hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "Hi"}]}
    base["max_tokens"] = 3
    for name in draw(st.lists(st.sampled_from(_FIELDS), max_size=4, unique=True)):
        base[name] = draw(_json)
    kind = draw(st.integers(0, 9))
    if kind == 0:  # deeply nested
        depth = draw(st.integers(50, 5000))
        return path, ('{"prompt": ' + "[" * depth + "]" * depth + "}").encode()
    if kind == 1:  # oversized field
        base["prompt" if path == "/v1/completions" else "user"] = "x" * draw(st.integers(10_000, 5_000_000))
    if kind == 2:  # NaN / Infinity literals
        return path, json.dumps(base).replace('"max_tokens": 3', '"max_tokens": 3, "temperature": NaN').encode()
    if kind == 3:
        base["stream"] = True
    return path, json.dumps(base, ensure_ascii=draw(st.booleans())).encode()


def test_fuzz_bodies_interleaved_with_valid_streams(server, http):
    expected = _greedy(http, PROMPTS[3], max_tokens=8)["choices"][0]["text"]
    seen: dict[int, int] = {}

    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(case=_bodies())
    def fuzz(case):
        path, raw = case

        async def both():
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
                valid = asyncio.ensure_future(_stream(c, _body(PROMPTS[3], max_tokens=8)))
                async with c.stream("POST", path, content=raw, headers={"Content-Type": "application/json"}) as r:
                    body = await r.aread()
                return r.status_code, body, await valid

        status, body, (text, reason, _) = asyncio.run(both())
        seen[status] = seen.get(status, 0) + 1
        assert status == 200 or 400 <= status < 500, (raw[:300], body[:500])
        if status != 200:
            err = json.loads(body)["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["type"], err
        elif body.startswith(b"data: "):
            assert body.rstrip().endswith(b"data: [DONE]") and b'"error"' not in body, body[-500:]
        assert (text, reason) == (expected, "length")

    fuzz()
    assert seen.get(400, 0) > 0
    _pool_whole(http)
    assert http.get("/health").status_code == 200
