"""SIGTERM drains the shared server: new work gets 503, the request in flight finishes, the process exits 0.

Runs last among the server tests (file order): it stops the package's server.
"""

from __future__ import annotations

import json
import signal
import time

import httpx

from tests.server.conftest import MODEL


def test_sigterm_drains_then_exits_zero(server):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 48, "temperature": 0, "ignore_eos": True,
            "stream": True}  # fmt: skip
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=120) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["choices"][0]["finish_reason"] is None
            server.proc.send_signal(signal.SIGTERM)
            # While draining: the listener is open, but nothing new is admitted.
            with httpx.Client(base_url=server.url, headers=server.headers, timeout=30) as other:
                deadline = time.monotonic() + 10
                while (health := other.get("/health")).status_code == 200 and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert health.status_code == 503 and health.json()["error"]["code"] == "shutting_down"
                late = other.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
                assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down"
            rest = [line[6:] for line in lines if line.startswith("data: ")]
    assert rest[-1] == "[DONE]"
    chunks = [json.loads(x) for x in rest[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert server.proc.wait(60) == 0, server.log_tail()
    log = server.log_tail(20000)
    assert "drained: no request in flight" in log
    # The engine's process ends with os._exit: nothing it made may be left for the resource tracker to warn of.
    assert "leaked semaphore" not in log, log[-2000:]
