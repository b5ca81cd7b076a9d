"""A real server (serve.py in a subprocess, on a free loopback port) shared by the server tests.

The model is the small default one with a small cache, to keep start-up and the tests quick on a 2-core machine.
The XLA compilation cache (~/.cache/jaxinfer/xla) makes every start after the first one much faster.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.tiny_model import SMOLLM2_SETTINGS, settings_flags

REPO = Path(__file__).resolve().parents[2]
MODEL = "smollm2-135m-instruct"
API_KEY = "sk-jaxinfer-test"
# A 64-token step budget and 8 rows (decode batches 1 and 8): 16 compiled steps, where 16 rows compiled 20 and a
# cold start took 38 s instead of 28; the engine tests that run SmolLM2 use the same settings, so most of the steps
# come from the XLA cache. Tests of more concurrent requests than rows queue them.
SERVER_ARGS = ["--model", MODEL, *settings_flags(SMOLLM2_SETTINGS)]
START_TIMEOUT_S = 900  # a cold start compiles every step: minutes on a busy 2-core machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    url: str
    log_path: Path

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {API_KEY}"}

    def log_tail(self, n: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-n:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def start_server(log_path: Path, *extra: str) -> ServerProcess:
    port = free_port()
    cmd = [sys.executable, str(REPO / "serve.py"), *SERVER_ARGS, "--host", "127.0.0.1", "--port", str(port), *extra]
    log = log_path.open("w")
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
    return ServerProcess(proc, f"http://127.0.0.1:{port}", log_path)


def wait_ready(server: ServerProcess, timeout: float = START_TIMEOUT_S) -> float:
    """Polls /health until 200; checks that it answers 503 (not a refused connection) while loading."""
    t0 = time.monotonic()
    seen_503 = False
    while time.monotonic() - t0 < timeout:
        if server.proc.poll() is not None:
            raise RuntimeError(f"server exited with {server.proc.returncode}:\n{server.log_tail()}")
        try:
            r = httpx.get(f"{server.url}/health", timeout=5)
        except httpx.TransportError:
            time.sleep(0.2)
            continue
        if r.status_code == 200:
            return time.monotonic() - t0
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading", r.text
        seen_503 = True
        time.sleep(0.5)
    raise TimeoutError(f"server not ready after {timeout}s (saw 503: {seen_503}):\n{server.log_tail()}")


def sse_chunks(client, path: str, body: dict) -> list[dict]:
    """The JSON chunks of a streamed response to `body` (with stream set), its status checked."""
    chunks = []
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: ") :]))
    return chunks


def pytest_collection_modifyitems(config, items) -> None:
    """test_shutdown.py stops the package's shared server: it runs after every other test of this package, whatever
    the files are named (a file that sorted after it found the server gone)."""
    here = [i for i, item in enumerate(items) if item.nodeid.startswith("tests/server/")]
    if not here:
        return
    block = [items[i] for i in here]
    last = [item for item in block if item.nodeid.startswith("tests/server/test_shutdown.py")]
    for i, item in zip(here, [item for item in block if item not in last] + last, strict=True):
        items[i] = item


@contextlib.contextmanager
def in_process(engine, tokenizer, name: str = "tiny", timeout: float = 300) -> Iterator:
    """The app on `engine` and `tokenizer` in this process (starlette's TestClient), once /health answers 200."""
    from starlette.testclient import TestClient

    from jaxinfer.server.app import build_app
    from jaxinfer.server.args import ServerArgs

    app = build_app(ServerArgs(model=name), lambda args: (engine, tokenizer))
    with TestClient(app) as client:
        deadline = time.monotonic() + timeout
        while client.get("/health").status_code != 200:
            assert time.monotonic() < deadline, client.get("/health").text
            time.sleep(0.02)
        yield client


@pytest.fixture(scope="package")
def server(tmp_path_factory) -> ServerProcess:
    srv = start_server(tmp_path_factory.mktemp("server") / "server.log", "--api-key", API_KEY)
    try:
        wait_ready(srv)
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="package")
def tokenizer():
    from jaxinfer.model_files import smollm2_gguf
    from jaxinfer.tokenizer import load_tokenizer

    return load_tokenizer(smollm2_gguf())


@pytest.fixture()
def http(server: ServerProcess):
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=120) as client:
        yield client


def held_pages(text: str) -> float:
    """KV pages requests hold, from a /metrics page: every used page but those a finished turn keeps for its
    session (a `user` field or X-Session-Id on the shared server), which TTL, the cap or memory pressure release.
    What a leak check must find at 0."""
    return metric(text, "jaxinfer:kv_cache_used_pages") - metric(text, "jaxinfer:session_pinned_pages")


def metric(text: str, name: str, **labels: str) -> float:
    """One sample's value from a /metrics page."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        m = re.fullmatch(rf"{re.escape(name)}(?:\{{(.*)\}})? (\S+)", line)
        if m and (m.group(1) or "") == want:
            return float(m.group(2))
    raise AssertionError(f"no {name}{{{want}}} on /metrics")
