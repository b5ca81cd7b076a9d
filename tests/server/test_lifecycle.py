"""Start-up, overload, engine failure and shutdown, on an in-process server (real uvicorn on a loopback port)
whose engine is `FakeEngine`: these states cannot be produced on demand with the real model."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from jaxinfer.server.app import build_app
from jaxinfer.server.args import ServerArgs
from jaxinfer.server.http import DrainingServer, uvicorn_config
from tests.server.conftest import REPO, free_port, start_server
from tests.server.fake_engine import FakeEngine

BODY = {"prompt": "Hello there", "max_tokens": 4}


class InProcessServer:
    def __init__(self, tokenizer, load_gate: threading.Event | None = None, fail_load: bool = False,
                 tracer_provider=None, **kw):  # fmt: skip
        self.engine = FakeEngine(tokenizer.vocab_size)
        self.load_gate = load_gate

        def loader(args):
            if self.load_gate is not None:
                assert self.load_gate.wait(30)
            if fail_load:
                raise FileNotFoundError("no such model")
            return self.engine, tokenizer

        self.args = ServerArgs(model="fake", port=free_port(), **kw)
        self.app = build_app(self.args, loader, tracer_provider)
        self.state = self.app.state.ctx.state
        config = uvicorn_config(self.app, self.args, host="127.0.0.1", log_level="warning", timeout_graceful_shutdown=1)
        self.server = DrainingServer(config, self.state, self.args.graceful_shutdown_timeout)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started and self.thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.args.port}"
        self.http = httpx.Client(base_url=self.url, timeout=30)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + 30
        while self.http.get("/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.02)

    def close(self) -> None:
        self.engine.paused = False
        if self.load_gate is not None:
            self.load_gate.set()
        self.http.close()
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture()
def make_server(tokenizer):
    servers = []

    def make(**kw) -> InProcessServer:
        servers.append(InProcessServer(tokenizer, **kw))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


def _error(r: httpx.Response, status: int, code: str) -> None:
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code, r.text


def test_503_while_loading_then_ready(make_server):
    gate = threading.Event()
    srv = make_server(load_gate=gate)
    _error(srv.http.get("/health"), 503, "model_loading")
    _error(srv.http.post("/v1/completions", json=BODY), 503, "model_loading")
    _error(srv.http.get("/v1/models"), 503, "model_loading")
    assert "jaxinfer:server_ready 0.0" in srv.http.get("/metrics").text
    gate.set()
    srv.wait_ready()
    r = srv.http.post("/v1/completions", json=BODY)  # no --api-key: no header needed
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert "jaxinfer:server_ready 1.0" in srv.http.get("/metrics").text


@pytest.mark.parametrize(
    ("module", "path", "body"),
    [("completions", "/v1/completions", BODY),
     ("chat", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})],
)  # fmt: skip
def test_a_whole_response_is_built_off_the_event_loop(make_server, monkeypatch, module, path, body):
    """n=128 choices with 20 top logprobs a token make a response of tens of MB: built and serialized on the event
    loop, it stalled /health and every stream for seconds. While one is built, the server still answers."""
    import importlib

    view = importlib.import_module(f"jaxinfer.server.{module}")._View
    building, release = threading.Event(), threading.Event()
    build = view.response

    def held(self, finals):
        building.set()
        assert release.wait(30)
        return build(self, finals)

    monkeypatch.setattr(view, "response", held)
    srv = make_server()
    srv.wait_ready()
    with ThreadPoolExecutor(1) as pool:
        try:
            answer = pool.submit(httpx.post, srv.url + path, json=body, timeout=60)
            assert building.wait(30)
            assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
        finally:
            release.set()
        assert answer.result().status_code == 200


def test_a_pool_smaller_than_the_context_is_the_limit_reported(make_server):
    """--num-kv-tokens 300 under --max-model-len 512: requests are held to 300 tokens, and /v1/models and /tokenize
    said 512."""
    gate = threading.Event()
    srv = make_server(load_gate=gate)
    srv.engine.runner.num_kv_tokens = 300
    gate.set()
    srv.wait_ready()
    assert srv.http.get("/v1/models").json()["data"][0]["max_model_len"] == 300
    assert srv.http.post("/tokenize", json={"prompt": "hi"}).json()["max_model_len"] == 300
    r = srv.http.post("/v1/completions", json={**BODY, "prompt": [5] * 290, "max_tokens": 20})
    assert r.status_code == 400 and "maximum context length is 300 tokens" in r.json()["error"]["message"], r.text


def test_allowed_origins_narrow_cors_and_a_refused_preflight_is_json(make_server):
    """--allowed-origins ORIGIN answers that origin's preflights, refuses others' in OpenAI's shape (it was
    Starlette's plain text), and with no origin at all the server sends no CORS header."""
    srv = make_server(allowed_origins=["https://app.example"])
    srv.wait_ready()
    ask = {"Access-Control-Request-Method": "POST"}
    ok = srv.http.options("/v1/completions", headers={"Origin": "https://app.example", **ask})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://app.example"
    refused = srv.http.options("/v1/completions", headers={"Origin": "https://evil.example", **ask})
    assert refused.status_code == 400 and refused.headers["content-type"] == "application/json"
    assert refused.json()["error"]["code"] == "cors_refused" and "origin" in refused.json()["error"]["message"]
    r = srv.http.post("/v1/completions", json=BODY, headers={"Origin": "https://evil.example"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers  # the browser refuses it
    off = make_server(allowed_origins=[])
    off.wait_ready()
    r = off.http.post("/v1/completions", json=BODY, headers={"Origin": "https://app.example"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_load_failure_stops_the_server(make_server):
    srv = make_server(fail_load=True)
    srv.thread.join(30)
    assert not srv.thread.is_alive() and srv.server.load_failed
    assert "no such model" in srv.state.error


def test_429_when_the_queue_is_full(make_server):
    srv = make_server(max_waiting=2)
    srv.wait_ready()
    srv.engine.paused = True  # nothing gets a first token: every admitted request stays waiting
    with ThreadPoolExecutor(2) as pool:
        held = [pool.submit(srv.http.post, "/v1/completions", json=BODY) for _ in range(2)]
        deadline = time.monotonic() + 10
        while srv.state.waiting < 2:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        r = srv.http.post("/v1/completions", json=BODY)
        _error(r, 429, "queue_full")
        assert r.headers["retry-after"] == "1"
        # One that no wait would ever let in is the client's to change: a 400 naming what to change.
        r = srv.http.post("/v1/completions", json={**BODY, "n": 3})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
        r = srv.http.post("/v1/completions", json={**BODY, "prompt": ["a", "b", "c"]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        srv.engine.paused = False
        assert [f.result().status_code for f in held] == [200, 200]
    assert srv.http.post("/v1/completions", json=BODY).status_code == 200
    assert srv.state.waiting == srv.state.in_flight == 0


def test_engine_death_is_503(make_server):
    srv = make_server()
    srv.wait_ready()
    srv.engine.fail_next_step = True
    _error(srv.http.post("/v1/completions", json=BODY), 503, "engine_dead")
    _error(srv.http.get("/health"), 503, "engine_dead")
    _error(srv.http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}), 503,
           "engine_dead")  # fmt: skip


def test_non_streaming_disconnect_aborts(make_server):
    srv = make_server()
    srv.wait_ready()
    srv.engine.paused = True
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{srv.url}/v1/completions", json=BODY, timeout=0.5)
    deadline = time.monotonic() + 10
    while srv.state.in_flight or srv.engine.seqs:
        assert time.monotonic() < deadline, (srv.state.in_flight, srv.engine.seqs)
        time.sleep(0.02)


def test_drain_timeout_aborts_what_is_left(make_server):
    """Requests still running at --graceful-shutdown-timeout end with 503 shutting_down in OpenAI's shape (a
    stream: in-band, then [DONE]), not uvicorn's plain-text 500 for a cancelled handler."""
    import json

    srv = make_server(graceful_shutdown_timeout=0.5)
    srv.wait_ready()
    srv.engine.paused = True
    with ThreadPoolExecutor(2) as pool, httpx.Client(base_url=srv.url, timeout=30) as c, c.stream(
        "POST", "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "stream": True,
                                              "max_tokens": 4},
    ) as r:  # fmt: skip
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")  # the role chunk: the request is in flight
        waiting = [pool.submit(srv.http.post, "/v1/completions", json=BODY) for _ in range(2)]
        deadline = time.monotonic() + 10
        while srv.state.in_flight < 3:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        srv.server.handle_exit(signal.SIGTERM, None)
        _error(srv.http.get("/health"), 503, "shutting_down")
        _error(srv.http.post("/v1/completions", json=BODY), 503, "shutting_down")
        for f in waiting:
            _error(f.result(30), 503, "shutting_down")
        rest = [line for line in lines if line]
        assert json.loads(rest[-2][len("data: ") :])["error"]["code"] == "shutting_down" and rest[-1] == "data: [DONE]"
        srv.thread.join(30)
        assert not srv.thread.is_alive()
    assert srv.state.in_flight == 0


def test_a_body_still_arriving_when_the_drain_ends_gets_a_503(make_server):
    """A client sending its body slowly when --graceful-shutdown-timeout passes: 503 shutting_down in OpenAI's shape,
    not the plain-text 500 of a handler uvicorn cancelled after its grace period."""
    import json
    import socket

    srv = make_server(graceful_shutdown_timeout=0.5)
    srv.wait_ready()
    body = json.dumps(BODY).encode()
    with socket.create_connection(("127.0.0.1", srv.args.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body[:5]))  # fmt: skip
        deadline = time.monotonic() + 10
        while not srv.server.server_state.tasks:  # its handler is reading the body
            assert time.monotonic() < deadline
            time.sleep(0.02)
        srv.server.handle_exit(signal.SIGTERM, None)
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            data = sock.recv(65536)
            if not data:
                break
            reply += data
    head, _, payload = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503"), reply
    assert json.loads(payload)["error"]["code"] == "shutting_down", reply
    srv.thread.join(30)
    assert not srv.thread.is_alive()


def test_sigterm_while_loading_exits_zero(tmp_path):
    """The real server, stopped while it compiles its steps: a clean exit, not an abort under XLA."""
    srv = start_server(tmp_path / "server.log")
    try:
        deadline = time.monotonic() + 120
        while "loaded in" not in srv.log_tail(20000):  # weights are in: the warm-up compilations run now
            assert srv.proc.poll() is None and time.monotonic() < deadline, srv.log_tail()
            time.sleep(0.1)
        _error(httpx.get(f"{srv.url}/health", timeout=5), 503, "model_loading")
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(60) == 0, srv.log_tail()
    finally:
        srv.stop()


def test_cli_rejects_parallelism_and_bad_models():
    r = subprocess.run([sys.executable, "serve.py", "--tensor-parallel-size", "0"], cwd=REPO, capture_output=True,
                       text=True, timeout=120)  # fmt: skip
    assert r.returncode == 2 and "tensor-parallel-size" in r.stderr
    port = str(free_port())
    r = subprocess.run([sys.executable, "serve.py", "--tensor-parallel-size", "2", "--port", port], cwd=REPO,
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 1 and "devices" in r.stdout + r.stderr  # one CPU device: a clear error, no hang
    port = str(free_port())
    r = subprocess.run([sys.executable, "serve.py", "--model", "/nonexistent/model.gguf", "--port", port],
                       cwd=REPO, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 1 and "does not exist" in r.stdout + r.stderr
