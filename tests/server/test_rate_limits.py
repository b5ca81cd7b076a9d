"""API keys from --api-keys-file and their limits (requests/tokens per minute, requests in flight), on in-process
servers in front of `FakeEngine`; the SIGHUP reload on a server process of its own (tests/server/fake_server.py)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from jaxinfer.server.args import parse_args
from jaxinfer.server.ratelimit import TokenBucket, duration
from tests.server.conftest import REPO, ServerProcess, free_port, metric, wait_ready
from tests.server.test_lifecycle import InProcessServer

BODY = {"prompt": "Hello there", "max_tokens": 4}
RATE_HEADERS = ("x-ratelimit-limit-requests", "x-ratelimit-remaining-requests", "x-ratelimit-reset-requests",
                "x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens")  # fmt: skip


def write_keys(path: Path, *keys: dict) -> Path:
    path.write_text("".join(json.dumps(k) + "\n" for k in keys))
    return path


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture()
def make_server(tokenizer, tmp_path):
    servers = []

    def make(*keys: dict, **kw) -> InProcessServer:
        srv = InProcessServer(tokenizer, api_keys_file=str(write_keys(tmp_path / "keys.jsonl", *keys)), **kw)
        servers.append(srv)
        srv.wait_ready()
        return srv

    yield make
    for s in servers:
        s.close()


def _rate_limited(r: httpx.Response, err_type: str) -> dict:
    assert r.status_code == 429, r.text
    err = r.json()["error"]
    assert err["code"] == "rate_limit_exceeded" and err["type"] == err_type and "Rate limit reached" in err["message"]
    return err


# ---------------------------------------------------------------------------------------------- units


def test_token_bucket_refills_at_its_rate_and_settles():
    b = TokenBucket(60, now=0.0)  # 1 a second
    b.add(-60, 0.0)
    assert b.remaining(0.0) == 0 and b.wait(3, 0.0) == pytest.approx(3.0)
    assert b.remaining(2.5) == 2 and b.reset_s(2.5) == pytest.approx(57.5)
    b.add(30, 2.5)  # a settled reservation gives back what was not used
    assert b.remaining(2.5) == 32
    assert b.wait(61, 100.0) == float("inf")  # more than the bucket holds: never
    assert [duration(s) for s in (0.0201, 1, 360, 3723.5)] == ["21ms", "1s", "6m0s", "1h2m3.5s"]


# ---------------------------------------------------------------------------------------------- over HTTP


def test_wrong_key_is_401_and_both_key_sources_work(make_server):
    srv = make_server({"id": "a", "key": "sk-a"}, api_key="sk-default")
    for headers in ({}, auth("sk-wrong"), auth("sk-a "[:-2]), {"Authorization": "Basic sk-a"}):
        r = srv.http.post("/v1/completions", json=BODY, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
        assert r.headers["www-authenticate"] == "Bearer"
    for key in ("sk-a", "sk-default"):
        assert srv.http.post("/v1/completions", json=BODY, headers=auth(key)).status_code == 200
    assert srv.http.get("/health").status_code == 200  # probes need no key
    text = srv.http.get("/metrics").text
    assert metric(text, "jaxinfer:api_key_requests_total", key_id="a") == 1
    assert metric(text, "jaxinfer:api_key_requests_total", key_id="default") == 1
    assert "sk-a" not in text and "sk-default" not in text


def test_requests_per_minute_burst(make_server):
    srv = make_server({"id": "a", "key": "sk-a", "rpm": 3})
    remaining = []
    for _ in range(3):
        r = srv.http.post("/v1/completions", json=BODY, headers=auth("sk-a"))
        assert r.status_code == 200 and r.headers["x-ratelimit-limit-requests"] == "3"
        remaining.append(int(r.headers["x-ratelimit-remaining-requests"]))
        assert "x-ratelimit-limit-tokens" not in r.headers  # no tpm limit: no token headers
    assert remaining == [2, 1, 0]
    r = srv.http.post("/v1/completions", json=BODY, headers=auth("sk-a"))
    err = _rate_limited(r, "requests")
    assert "requests per min (RPM): Limit 3" in err["message"]
    # One request comes back every 20 s: Retry-After says when, in whole seconds and (as OpenAI) in ms.
    assert 18 <= int(r.headers["retry-after"]) <= 20 and 18000 <= int(r.headers["retry-after-ms"]) <= 20000
    assert r.headers["x-ratelimit-remaining-requests"] == "0"
    assert re.fullmatch(r"(\d+m)?[\d.]+s", r.headers["x-ratelimit-reset-requests"])
    text = srv.http.get("/metrics").text
    assert metric(text, "jaxinfer:api_key_rate_limited_total", key_id="a", limit="rpm") == 1
    assert metric(text, "jaxinfer:api_key_requests_total", key_id="a") == 3
    assert metric(text, "jaxinfer:api_key_limit", key_id="a", limit="rpm") == 3


def test_tokens_reserved_at_admission_and_settled_to_use(make_server):
    srv = make_server({"id": "t", "key": "sk-t", "tpm": 400})
    srv.engine.stop_after = 3  # every sequence ends after 3 tokens, whatever max_tokens reserved
    body = {"prompt": "Hello there", "max_tokens": 300}
    r = srv.http.post("/v1/completions", json=body, headers=auth("sk-t"))
    usage = r.json()["usage"]
    prompt = usage["prompt_tokens"]
    assert r.status_code == 200 and usage["completion_tokens"] == 3
    # The response's headers are read after it settled: what is left is 400 - what it used, plus the refill.
    left = int(r.headers["x-ratelimit-remaining-tokens"])
    assert 400 - (prompt + 3) <= left <= 400 - (prompt + 3) + 2
    text = srv.http.get("/metrics").text
    assert metric(text, "jaxinfer:api_key_tokens_total", key_id="t", kind="prompt") == prompt
    assert metric(text, "jaxinfer:api_key_tokens_total", key_id="t", kind="completion") == 3

    # While a request runs, its whole prompt + max_tokens is held: a second one that does not fit beside it is 429.
    srv.engine.paused = True
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(srv.http.post, "/v1/completions", json={**body, "max_tokens": 350}, headers=auth("sk-t"))
        deadline = time.monotonic() + 10
        while srv.state.in_flight < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        r = srv.http.post("/v1/completions", json=body, headers=auth("sk-t"))
        err = _rate_limited(r, "tokens")
        assert "tokens per min (TPM): Limit 400" in err["message"] and int(r.headers["retry-after"]) >= 1
        assert int(r.headers["x-ratelimit-remaining-tokens"]) < prompt + 300
        srv.engine.paused = False
        assert held.result().status_code == 200
    # Settled again: 300 more fit now.
    assert srv.http.post("/v1/completions", json=body, headers=auth("sk-t")).status_code == 200
    # A request larger than the whole limit can never run: 429 without Retry-After.
    r = srv.http.post("/v1/completions", json={**body, "max_tokens": 450}, headers=auth("sk-t"))
    assert "Request too large" in _rate_limited(r, "tokens")["message"] and "retry-after" not in r.headers


def test_concurrent_requests_limit(make_server):
    srv = make_server({"id": "c", "key": "sk-c", "max_concurrent": 2})
    srv.engine.paused = True
    stream = {**BODY, "stream": True}
    with ThreadPoolExecutor(2) as pool:
        held = [pool.submit(srv.http.post, "/v1/completions", json=stream, headers=auth("sk-c")) for _ in range(2)]
        deadline = time.monotonic() + 10
        while srv.state.in_flight < 2:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        r = srv.http.post("/v1/completions", json=BODY, headers=auth("sk-c"))
        assert "2 requests in flight, at most 2" in _rate_limited(r, "requests")["message"]
        assert r.headers["retry-after"] == "1"
        assert metric(srv.http.get("/metrics").text, "jaxinfer:api_key_requests_in_flight", key_id="c") == 2
        srv.engine.paused = False
        assert [f.result().status_code for f in held] == [200, 200]
    assert srv.http.post("/v1/completions", json=BODY, headers=auth("sk-c")).status_code == 200
    assert metric(srv.http.get("/metrics").text, "jaxinfer:api_key_requests_in_flight", key_id="c") == 0


def test_mixed_burst_from_three_keys_keeps_every_limit(make_server):
    rpm, tpm, conc = 6, 300, 2
    srv = make_server({"id": "r", "key": "sk-r", "rpm": rpm}, {"id": "t", "key": "sk-t", "tpm": tpm},
                      {"id": "c", "key": "sk-c", "max_concurrent": conc})  # fmt: skip
    srv.engine.step_delay = 0.005  # 40 tokens take 0.2 s: requests overlap
    usage = {u.key.id: u for u in srv.app.state.ctx.limiter.usage()}
    peak = {"c": 0}
    done = threading.Event()

    def watch() -> None:  # the server's own count of c's requests in flight, sampled through the burst
        while not done.is_set():
            peak["c"] = max(peak["c"], usage["c"].in_flight)
            time.sleep(0.001)

    def call(kid: str, i: int) -> tuple[str, int]:
        body = {"prompt": f"burst {i}", "max_tokens": 40, "stream": kid == "c"}
        r = srv.http.post("/v1/completions", json=body, headers=auth(f"sk-{kid}"))
        return kid, r.status_code

    watcher = threading.Thread(target=watch)
    watcher.start()
    t0 = time.monotonic()
    jobs = [(kid, i) for i in range(12) for kid in ("r", "t", "c")]
    try:
        with ThreadPoolExecutor(12) as pool:
            results = list(pool.map(lambda job: call(*job), jobs))
    finally:
        done.set()
        watcher.join()
    elapsed = time.monotonic() - t0
    ok = {kid: sum(1 for k, s in results if k == kid and s == 200) for kid in "rtc"}
    assert all(s in (200, 429) for _, s in results), results
    # No key past its limit: the buckets refill during the burst, by at most rate x elapsed.
    assert ok["r"] <= rpm + rpm / 60 * elapsed and sum(1 for k, s in results if k == "r" and s == 429) >= 1
    text = srv.http.get("/metrics").text
    used = sum(metric(text, "jaxinfer:api_key_tokens_total", key_id="t", kind=k) for k in ("prompt", "completion"))
    assert used <= tpm + tpm / 60 * elapsed and metric(text, "jaxinfer:api_key_rate_limited_total", key_id="t",
                                                       limit="tpm") >= 1  # fmt: skip
    assert peak["c"] == conc and ok["c"] >= conc
    assert metric(text, "jaxinfer:api_key_rate_limited_total", key_id="c", limit="max_concurrent") >= 1
    # The server is healthy and holds nothing: every slot, sequence and page came back.
    assert srv.http.get("/health").status_code == 200
    assert srv.state.in_flight == srv.state.waiting == 0 and srv.engine.allocator.num_used == 0
    for kid in "rtc":
        assert metric(text, "jaxinfer:api_key_requests_in_flight", key_id=kid) == 0
    assert srv.http.post("/v1/completions", json=BODY, headers=auth("sk-c")).status_code == 200


def test_bad_keys_file_stops_the_start(tmp_path, capsys):
    bad = tmp_path / "keys.jsonl"
    for text, says in (('{"id": "a", "key": "sk-a", "rpm": 0}\n', "keys.jsonl:1: `rpm` must be a positive integer"),
                       ('{"id": "a", "key": "sk-a"}\n{"id": "a", "key": "sk-b"}\n', "key id 'a' appears twice"),
                       ('\n{"id": "b", "key": "sk-b"}\n{not json\n', "keys.jsonl:3: not JSON"),
                       ('{"id": "a", "key": "sk-a", "burst": 3}\n', "unknown field(s) ['burst']"),
                       ('{"id": "a", "key": " sk-a"}\n', "keys.jsonl:1: `key` has spaces around it")):  # fmt: skip
        bad.write_text(text)
        with pytest.raises(SystemExit) as e:
            parse_args(["--api-keys-file", str(bad)])
        err = capsys.readouterr().err
        assert e.value.code == 2 and says in err and "sk-" not in err, err
    with pytest.raises(SystemExit):
        parse_args(["--api-keys-file", str(tmp_path / "missing.jsonl")])
    assert "missing.jsonl" in capsys.readouterr().err


def test_a_sighup_during_the_start_is_a_reload_once_serving(tmp_path):
    """SIGHUP's default action ends the process: before the server's handler is in place, one (a supervisor's
    reload, a key-rotation cron) is remembered, and the keys are read again once the server serves."""
    keys = write_keys(tmp_path / "keys.jsonl", {"id": "a", "key": "sk-a"})
    port = free_port()
    log = (tmp_path / "server.log").open("w")
    cmd = [sys.executable, "-m", "tests.server.fake_server", "--port", str(port), "--api-keys-file", str(keys)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "FAKE_SERVER_HANGUP_AT_START": "1"})  # fmt: skip
    try:
        wait_ready(ServerProcess(proc, f"http://127.0.0.1:{port}", tmp_path / "server.log"), timeout=60)
        assert httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=BODY, headers=auth("sk-a"),
                          timeout=30).status_code == 200  # fmt: skip
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert "API keys reloaded: 1 key(s) (a)" in (tmp_path / "server.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_keys_file_reload_on_sighup(tmp_path):
    keys = write_keys(tmp_path / "keys.jsonl", {"id": "a", "key": "sk-a", "rpm": 1})
    port = free_port()
    log = (tmp_path / "server.log").open("w")
    cmd = [sys.executable, "-m", "tests.server.fake_server", "--port", str(port), "--api-keys-file", str(keys),
           "--log-level", "warning"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_ready(ServerProcess(proc, f"http://127.0.0.1:{port}", tmp_path / "server.log"), timeout=60)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
            assert http.post("/v1/completions", json=BODY, headers=auth("sk-a")).status_code == 200
            assert http.post("/v1/completions", json=BODY, headers=auth("sk-a")).status_code == 429
            assert http.post("/v1/completions", json=BODY, headers=auth("sk-b")).status_code == 401
            # a's limit raised, b added.
            write_keys(keys, {"id": "a", "key": "sk-a", "rpm": 100}, {"id": "b", "key": "sk-b"})
            proc.send_signal(signal.SIGHUP)
            deadline = time.monotonic() + 10
            while http.post("/v1/completions", json=BODY, headers=auth("sk-b")).status_code != 200:
                assert time.monotonic() < deadline, "the new key never worked"
                time.sleep(0.05)
            r = http.post("/v1/completions", json=BODY, headers=auth("sk-a"))
            assert r.status_code == 200 and r.headers["x-ratelimit-limit-requests"] == "100"
            assert r.headers["x-ratelimit-remaining-requests"] == "98"  # what a used stays used
            # A broken file keeps the keys in use, and the server up.
            keys.write_text("{broken\n")
            proc.send_signal(signal.SIGHUP)
            time.sleep(0.5)
            assert http.post("/v1/completions", json=BODY, headers=auth("sk-b")).status_code == 200
            assert http.get("/health").status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        text = (tmp_path / "server.log").read_text()
        assert "API keys not reloaded" in text and "sk-a" not in text and "sk-b" not in text
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
