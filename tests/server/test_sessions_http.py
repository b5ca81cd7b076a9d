"""Sessions over HTTP, through the engine process (serve.py's default), on a tiny random-weight model: an
`X-Session-Id` header (else the `user` field) keeps a conversation's KV pages for its next turn, which then starts
on them; replies are the same tokens as without a session; /metrics shows the session and host-tier counters; a
malformed session id is a 400 naming it."""

from __future__ import annotations

import re

import httpx
import pytest

from tests.server.conftest import wait_ready
from tests.server.test_engine_process import _start, tiny_model  # noqa: F401 - fixture

HOST_BYTES = 1 << 20


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):  # noqa: F811
    srv = _start(tiny_model, tmp_path_factory.mktemp("sessions") / "server.log",
                 "--host-kv-cache-memory", "1MiB", "--session-ttl", "600")  # fmt: skip
    try:
        wait_ready(srv)
        yield srv
    finally:
        srv.stop()


def _metric(http: httpx.Client, name: str) -> float:
    text = http.get("/metrics").text
    m = re.search(rf"^jaxinfer:{name} (\S+)$", text, re.M)
    assert m, f"no jaxinfer:{name} in /metrics"
    return float(m.group(1))


def _chat(http: httpx.Client, messages: list[dict], headers: dict | None = None) -> tuple[str, dict]:
    body = {"messages": messages, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    r = http.post("/v1/chat/completions", json=body, headers=headers or {})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"], r.json()["usage"]


def test_second_turn_starts_on_the_first_turns_pages(server):
    with httpx.Client(base_url=server.url, timeout=120) as http:
        assert _metric(http, "host_kv_cache_capacity_bytes") == HOST_BYTES
        hits, hit_tokens = _metric(http, "session_hits_total"), _metric(http, "session_hit_tokens_total")
        convo = [{"role": "user", "content": "Tell me about the sea, in a few words please."}]
        reply, first = _chat(http, convo, {"X-Session-Id": "conv-1"})
        assert _metric(http, "session_count") >= 1 and _metric(http, "session_pinned_pages") >= 1
        convo += [{"role": "assistant", "content": reply}, {"role": "user", "content": "And about rivers?"}]
        second, usage = _chat(http, convo, {"X-Session-Id": "conv-1"})
        assert _metric(http, "session_hits_total") == hits + 1
        # The first turn's prompt came from its pinned pages (usage reports them as cached), up to the token where
        # the re-rendered conversation's tokens part from the computed ones (BPE merges across the template's
        # newline): reuse is token by token, not page by page.
        reused = _metric(http, "session_hit_tokens_total") - hit_tokens
        assert reused >= first["prompt_tokens"] - 2 and usage["prompt_tokens_details"]["cached_tokens"] == reused
        assert _chat(http, convo)[0] == second  # the same tokens without a session


def test_user_field_names_the_session(server):
    body = {"prompt": "Once upon a time there was a", "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "user": "alice"}  # fmt: skip
    with httpx.Client(base_url=server.url, timeout=120) as http:
        hits = _metric(http, "session_hits_total")
        first = http.post("/v1/completions", json=body)
        assert first.status_code == 200, first.text
        body["prompt"] += first.json()["choices"][0]["text"] + " and then"
        second = http.post("/v1/completions", json=body)
        assert second.status_code == 200, second.text
        assert _metric(http, "session_hits_total") == hits + 1
        del body["user"]
        assert (
            http.post("/v1/completions", json=body).json()["choices"][0]["text"] == second.json()["choices"][0]["text"]
        )


@pytest.mark.parametrize(
    "headers, extra, param",
    [({"X-Session-Id": "bad id with spaces"}, {}, "X-Session-Id"), ({}, {"user": "u" * 300}, "user")],
)
def test_bad_session_id_is_a_400(server, headers, extra, param):
    body = {"prompt": "Hi", "max_tokens": 2, **extra}
    r = httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_header_wins_over_user():
    from starlette.requests import Request

    from jaxinfer.server.context import session_id

    def request(*headers: tuple[bytes, bytes]) -> Request:
        return Request({"type": "http", "method": "POST", "path": "/", "headers": list(headers)})

    assert session_id(request((b"x-session-id", b"conv-9")), "alice") == "conv-9"
    assert session_id(request(), "alice") == "alice"
    assert session_id(request(), None) is None and session_id(request(), "") is None
