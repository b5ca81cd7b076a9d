"""Monitoring of requests: the span tree of one request's OpenTelemetry trace (in-memory exporter), the JSON access
log, the latency and hit-rate histograms, and usage's cached_tokens; on an in-process server in front of
`FakeEngine`, whose prompts are "prefilled" in chunks and whose first token reports the engine's timeline."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from jaxinfer.server.app import build_app
from jaxinfer.server.args import ServerArgs
from tests.server.conftest import REPO, metric
from tests.server.test_lifecycle import InProcessServer
from tests.server.test_rate_limits import auth, write_keys

PROMPT = list(range(100, 110))  # 10 token ids: with 4 per prefill step, chunks of 4, 4 and 2
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"


@pytest.fixture()
def traced(tokenizer, tmp_path):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    keys = write_keys(tmp_path / "keys.jsonl", {"id": "team-a", "key": "sk-secret-a", "tpm": 10000})
    srv = InProcessServer(tokenizer, tracer_provider=provider, api_keys_file=str(keys),
                          access_log_file=str(tmp_path / "access.jsonl"))  # fmt: skip
    srv.wait_ready()
    srv.engine.prefill_chunk = 4
    srv.engine.step_delay = 0.002  # steps take time, as on a device: every span has a length
    yield srv, exporter, tmp_path / "access.jsonl"
    srv.close()


def _access_lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_span_tree_of_one_request(traced):
    srv, exporter, _ = traced
    headers = {**auth("sk-secret-a"), "traceparent": f"00-{TRACE_ID}-{CALLER_SPAN}-01", "X-Request-Id": "trace-me"}
    r = srv.http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 5}, headers=headers)
    assert r.status_code == 200, r.text
    spans = exporter.get_finished_spans()
    (root,) = [s for s in spans if s.name == "llm_request"]
    children = sorted((s for s in spans if s is not root), key=lambda s: s.start_time)
    # One trace, joined to the caller's; everything else hangs off the request's span.
    assert f"{root.context.trace_id:032x}" == TRACE_ID and f"{root.parent.span_id:016x}" == CALLER_SPAN
    assert all(s.parent.span_id == root.context.span_id and s.context.trace_id == root.context.trace_id
               for s in children)  # fmt: skip
    assert [s.name for s in children] == ["queue", "prefill_chunk", "prefill_chunk", "prefill_chunk", "decode",
                                          "detokenize"]  # fmt: skip
    queue, *chunks, decode, detok = children
    assert [c.attributes["jaxinfer.prompt_tokens"] for c in chunks] == [4, 4, 2]
    assert [c.attributes["jaxinfer.chunk_index"] for c in chunks] == [0, 1, 2]
    # The timeline in order: admission <= queue <= chunks, one after the other <= decode <= the request's end.
    assert root.start_time <= queue.start_time <= queue.end_time <= chunks[0].start_time
    for a, b in zip(chunks, chunks[1:], strict=False):
        assert a.start_time < a.end_time <= b.start_time
    assert chunks[-1].end_time <= decode.start_time < decode.end_time <= root.end_time
    assert decode.start_time == detok.start_time and detok.end_time <= root.end_time
    assert 0 < detok.attributes["jaxinfer.detokenize_seconds"] < (detok.end_time - detok.start_time) / 1e9 + 1e-3
    a = root.attributes
    assert a["gen_ai.request.id"] == "trace-me" and a["jaxinfer.key_id"] == "team-a"
    assert a["gen_ai.usage.prompt_tokens"] == 10 and a["gen_ai.usage.completion_tokens"] == 5
    assert a["gen_ai.response.finish_reasons"] == ("length",) and a["http.response.status_code"] == 200
    assert a["gen_ai.latency.time_in_queue"] == pytest.approx((queue.end_time - queue.start_time) / 1e9, abs=1e-6)
    assert 0 < a["gen_ai.latency.time_to_first_token"] < a["gen_ai.latency.e2e"]
    assert decode.attributes["gen_ai.usage.completion_tokens"] == 5
    assert "sk-secret-a" not in repr([dict(s.attributes) for s in spans])


def test_access_log_and_histograms(traced):
    srv, _, path = traced
    r = srv.http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 5, "n": 2},
                      headers={**auth("sk-secret-a"), "X-Request-Id": "logged"})  # fmt: skip
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert r.headers["x-request-id"] == r.json()["id"] == "logged"  # the client's id comes back
    streamed = srv.http.post("/v1/chat/completions", headers=auth("sk-secret-a"), json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True,
        "stream_options": {"include_usage": True}})  # fmt: skip
    chunks = streamed.text
    assert '"prompt_tokens_details":{"cached_tokens":0}' in chunks
    assert json.loads(chunks.split("data: ", 2)[1])["id"] == streamed.headers["x-request-id"]  # the server's id
    assert srv.http.post("/v1/completions", json={"prompt": PROMPT}, headers=auth("sk-wrong")).status_code == 401
    lines = _access_lines(path)
    assert [(x["endpoint"], x["status"]) for x in lines] == [("/v1/completions", 200), ("/v1/chat/completions", 200),
                                                             ("/v1/completions", 401)]  # fmt: skip
    first, chat, refused = lines
    assert first["id"] == "logged" and first["key_id"] == "team-a" and first["stream"] is False
    assert (first["prompt_tokens"], first["cached_tokens"], first["output_tokens"]) == (10, 0, 10)
    assert first["finish_reason"] == ["length", "length"]
    assert 0 <= first["queue_time_s"] <= first["ttft_s"] < first["e2e_s"]
    assert chat["stream"] is True and chat["output_tokens"] == 3 and chat["id"].startswith("chatcmpl-")
    assert refused == {"time": refused["time"], "id": None, "key_id": None, "endpoint": "/v1/completions",
                       "status": 401, "error": "invalid_api_key"}  # fmt: skip
    assert "sk-secret-a" not in path.read_text()
    text = srv.http.get("/metrics").text
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prefix_cache_hit_rate"):  # fmt: skip
        assert metric(text, f"jaxinfer:{name}_count") == 2, name  # one per engine request
    assert metric(text, "jaxinfer:inter_token_latency_seconds_count") >= 4
    assert metric(text, "jaxinfer:request_prefix_cache_hit_rate_bucket", le="0.0") == 2  # the fake caches nothing
    assert metric(text, "jaxinfer:request_host_cache_hit_rate_count") == 0  # no host KV tier here


def test_no_access_log_and_no_opentelemetry_needed(tokenizer, monkeypatch, caplog):
    srv = InProcessServer(tokenizer, access_log=False)
    try:
        srv.wait_ready()
        with caplog.at_level("INFO", logger="jaxinfer.access"):
            assert srv.http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}).status_code == 200
        assert not [r for r in caplog.records if r.name == "jaxinfer.access"]
    finally:
        srv.close()
    # Without the OpenTelemetry SDK installed the server imports and builds (only --otlp-traces-endpoint needs it;
    # fastapi itself may bring opentelemetry-api), in a fresh interpreter where it cannot be imported...
    code = ("import sys; sys.modules['opentelemetry.sdk'] = None\n"
            "from jaxinfer.server.app import build_app; from jaxinfer.server.args import ServerArgs\n"
            "build_app(ServerArgs(model='fake'), lambda _: None)\n"
            "assert not [m for m in sys.modules if m.startswith('opentelemetry.sdk') and sys.modules[m]]")  # fmt: skip
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    # ... and here, where the flag says what to install.
    for name in [m for m in sys.modules if m.startswith("opentelemetry.sdk")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk", None)
    build_app(ServerArgs(model="fake"), lambda _: None)
    with pytest.raises(RuntimeError, match=r"jaxinfer\[otel\]"):
        build_app(ServerArgs(model="fake", otlp_traces_endpoint="http://127.0.0.1:4317"), lambda _: None)


def test_hit_rate_histograms_and_the_host_tier_hook():
    """A host KV tier reports its hits through Request.num_host_cached_tokens -> SeqTiming -> RequestMetrics; the
    server's histograms take both rates from there."""
    from jaxinfer.server.metrics import Metrics
    from jaxinfer.server.state import ServerState
    from jaxinfer.types import RequestMetrics

    m = Metrics(ServerState(ServerArgs(model="fake")))
    m.first_token(0.5, 10, RequestMetrics(100.0, 100.25, 100.5, None, num_cached_tokens=4))
    m.first_token(0.5, 10, RequestMetrics(100.0, 100.0, 100.5, None, num_cached_tokens=4, num_host_cached_tokens=6))
    text = m.render().decode()
    assert metric(text, "jaxinfer:request_prefix_cache_hit_rate_sum") == pytest.approx(0.8)
    assert metric(text, "jaxinfer:request_host_cache_hit_rate_count") == 1
    assert metric(text, "jaxinfer:request_host_cache_hit_rate_sum") == pytest.approx(0.6)
    assert metric(text, "jaxinfer:request_queue_time_seconds_sum") == pytest.approx(0.25)


def test_a_scored_prompt_is_logged_and_charged_without_output(traced):
    """echo with max_tokens 0 scores the prompt: the token the engine makes meanwhile is no output, in the access
    log and the key's token count as in usage."""
    srv, _, path = traced
    before = metric(srv.http.get("/metrics").text, "jaxinfer:api_key_tokens_total", key_id="team-a", kind="completion")
    r = srv.http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 0, "echo": True},
                      headers=auth("sk-secret-a"))  # fmt: skip
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 0, r.text
    (line,) = _access_lines(path)
    assert (line["output_tokens"], line["finish_reason"]) == (0, ["length"])
    text = srv.http.get("/metrics").text
    assert metric(text, "jaxinfer:api_key_tokens_total", key_id="team-a", kind="completion") == before


def test_a_stream_its_client_left_is_logged_as_499(traced):
    """A client that stops reading a stream and closes the connection: 499 client_disconnected in the access log,
    as for a non-streamed request, not a 200."""
    import time

    import httpx

    srv, _, path = traced
    srv.engine.step_delay = 0.05
    body = {"prompt": PROMPT, "max_tokens": 200, "stream": True}
    with (
        httpx.Client(base_url=srv.url, timeout=30) as c,
        c.stream("POST", "/v1/completions", json=body, headers=auth("sk-secret-a")) as r,
    ):
        assert next(r.iter_lines()).startswith("data: ")
    deadline = time.monotonic() + 10
    while srv.state.in_flight or not path.exists() or not path.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    (line,) = _access_lines(path)
    assert (line["status"], line["error"]) == (499, "client_disconnected") and line["stream"] is True


def test_every_api_response_of_a_limited_key_carries_its_headers_and_a_log_line(traced):
    """/v1/models, /tokenize and a 400 carry the key's x-ratelimit-* headers (deployment.md: every response of a
    limited key) and the client's X-Request-Id; the routes without an admission leave their access-log line."""
    srv, _, path = traced
    headers = {**auth("sk-secret-a"), "X-Request-Id": "find-me"}
    answers = [
        srv.http.get("/v1/models", headers=headers),
        srv.http.post("/tokenize", json={"prompt": "hi"}, headers=headers),
        srv.http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": -1}, headers=headers),
    ]
    assert [r.status_code for r in answers] == [200, 200, 400]
    for r in answers:
        assert r.headers["x-ratelimit-limit-tokens"] == "10000" and r.headers["x-request-id"] == "find-me", r.headers
    assert srv.http.get("/health").status_code == 200
    lines = [(x["id"], x["key_id"], x["endpoint"], x["status"]) for x in _access_lines(path)]
    assert lines == [("find-me", "team-a", "/v1/models", 200), ("find-me", "team-a", "/tokenize", 200),
                     ("find-me", "team-a", "/v1/completions", 400)]  # fmt: skip


def test_a_stream_its_client_stopped_reading_ends_and_frees_its_slot(tokenizer, tmp_path):
    """A client that stops reading but keeps the connection: once a send has waited past --stream-stall-timeout
    the response ends (408 in the access log), so the request leaves the server's and its key's in-flight counts.
    It used to stay in flight for as long as the connection lasted: the key's max_concurrent slot was gone."""
    import socket
    import time
    from urllib.parse import urlsplit

    keys = write_keys(tmp_path / "keys.jsonl", {"id": "a", "key": "sk-a", "max_concurrent": 1})
    srv = InProcessServer(tokenizer, api_keys_file=str(keys), stream_stall_timeout=1.0, max_stream_buffer=16,
                          access_log_file=str(tmp_path / "access.jsonl"))  # fmt: skip
    try:
        srv.wait_ready()
        srv.engine.step_delay = 0.002
        body = json.dumps({"prompt": "hi", "max_tokens": 500, "n": 64, "stream": True}).encode()
        url = urlsplit(srv.url)
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect((url.hostname, url.port))
            head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-a\r\n"
            sock.sendall(head + b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            deadline = time.monotonic() + 30
            while not srv.state.in_flight:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            while srv.state.in_flight:  # never read: the server must give up on it by itself
                assert time.monotonic() < deadline, srv.state.in_flight
                time.sleep(0.05)
            r = srv.http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=auth("sk-a"))
            assert r.status_code == 200, r.text  # the key's one slot is free again
        (line, *_) = _access_lines(tmp_path / "access.jsonl")
        assert (line["status"], line["error"]) == (408, "client_stopped_reading")
    finally:
        srv.close()


def test_a_body_that_never_arrives_whole_is_a_408(tokenizer, monkeypatch):
    """A client that sends part of its body and then nothing (slowloris) holds a connection and the bytes sent so
    far until the body deadline, then gets a 408 in OpenAI's shape; it used to hold them for as long as it liked."""
    import socket
    from urllib.parse import urlsplit

    from jaxinfer.server import body

    monkeypatch.setattr(body, "BODY_TIMEOUT_S", 0.5)
    srv = InProcessServer(tokenizer)
    try:
        srv.wait_ready()
        url = urlsplit(srv.url)
        with socket.create_connection((url.hostname, url.port), timeout=20) as sock:
            sock.sendall(b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{"prompt": "hi"')
            answer = b""
            while b"}}" not in answer:
                more = sock.recv(4096)
                assert more, answer
                answer += more
        head, _, rest = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408") and json.loads(rest)["error"]["code"] == "request_timeout", answer
    finally:
        srv.close()
