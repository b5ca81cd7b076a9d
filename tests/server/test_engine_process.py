"""The engine core in its own process (--engine-process, serve.py's default), on a tiny random-weight model:
the same tokens as the in-process engine, many streams at once, stop strings found on the API side, the same 400s,
a killed core (streams end with an error, 503s, the server exits), no core left behind by a server that stops
or is killed, and a model that cannot load named in one line (a traceback only for a bug).

One server serves the output tests and then stops with SIGTERM; a second one has its core killed; a third one is
killed while its core loads. Warm starts take seconds thanks to the XLA compilation cache.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import ServerProcess, metric, start_server, wait_ready
from tests.server.fake_engine import FakeEngine
from tests.tiny_model import SETTINGS, settings_flags, write_tiny_model

FAIL_TOKEN = 999  # a prompt ending with it makes the fake core's engine raise in its step

PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time", "1, 2, 3, 4,"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny") / "ck"
    write_tiny_model(path)
    return path


def _start(model: Path, log_path: Path, *extra: str) -> ServerProcess:
    return start_server(log_path, "--model", str(model), *settings_flags(), *extra)  # later flags win over conftest's


def _core_pid(srv: ServerProcess, timeout: float = 60) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = re.search(r"engine core process started \(pid (\d+)\)", srv.log_tail(100_000))
        if m:
            return int(m.group(1))
        assert srv.proc.poll() is None, srv.log_tail()
        time.sleep(0.05)
    raise TimeoutError(srv.log_tail())


def _running(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie waiting for a reaper counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _wait_gone(pid: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while _running(pid):
        assert time.monotonic() < deadline, f"process {pid} still running"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    srv = _start(tiny_model, tmp_path_factory.mktemp("core-server") / "server.log")
    try:
        wait_ready(srv)
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def reference(tiny_model):
    """The in-process engine on the same model and settings."""
    from jaxinfer import LLM

    with LLM(str(tiny_model), **SETTINGS) as llm:
        yield llm


def _body(prompt: str, **kw) -> dict:
    return {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True, **kw}


async def _stream(client: httpx.AsyncClient, body: dict) -> tuple[str, str | None, list]:
    text, reason, events = "", None, []
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            if line[6:] == "[DONE]":
                continue
            data = json.loads(line[6:])
            if "error" in data:
                continue
            choice = data["choices"][0]
            text += choice["text"]
            reason = choice["finish_reason"] or reason
    return text, reason, events


def test_validation_is_the_engines(reference):
    """The API side validates with `Engine.validate` itself, on the limits the core sends over the wire."""
    from jaxinfer import SamplingParams
    from jaxinfer.engine.core_process import engine_facts, pack, unpack
    from jaxinfer.engine.mp_engine import _Validator

    engine = reference.engine
    validator = _Validator(unpack(pack(engine_facts(engine, reference.tokenizer))))
    sp = SamplingParams
    cases = [
        ([1, 2, 3], sp()),
        ([], sp()),
        ([1, 49152], sp()),
        ([1] * 100, sp(max_tokens=SETTINGS["max_model_len"] - 99)),  # one past the context
        ([1] * 100, sp(max_tokens=SETTINGS["max_model_len"] - 100)),
        ([1], sp(logprobs=20)),
        ([1], sp(logprobs=20, prompt_logprobs=20)),
        ([1], sp(logit_bias={60000: 1.0})),
        ([1], sp(stop_token_ids=(49152,))),
        ([1], sp(logit_bias={i: 1.0 for i in range(600)})),
        ([1], sp(min_tokens=1, stop_token_ids=tuple(range(511)))),
    ]
    for ids, params in cases:
        results = []
        for v in (engine, validator):
            try:
                results.append(v.validate(ids, params))
            except ValueError as e:
                results.append(f"ValueError: {e}")
        assert results[0] == results[1], (ids, params)


def test_same_tokens_as_in_process(server, reference):
    from jaxinfer import SamplingParams

    refs = reference.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1),
                              use_tqdm=False)  # fmt: skip
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for prompt, ref in zip(PROMPTS, refs, strict=True):
            want = ref.outputs[0]
            r = http.post("/v1/completions", json=_body(prompt, logprobs=1))
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert choice["text"] == want.text and choice["finish_reason"] == "length"
            assert r.json()["usage"]["completion_tokens"] == len(want.token_ids) == 12
            want_lp = [lp[t] for t, lp in zip(want.token_ids, want.logprobs, strict=True)]
            assert choice["logprobs"]["token_logprobs"] == pytest.approx(want_lp, abs=1e-4)

    async def streams():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            return await asyncio.gather(*(_stream(c, _body(p)) for p in PROMPTS))

    for (text, reason, events), ref in zip(asyncio.run(streams()), refs, strict=True):
        assert (text, reason, events[-1]) == (ref.outputs[0].text, "length", "[DONE]")
    # The core's timeline of each request (queue time, prefill chunks, cached tokens) crossed the process boundary
    # with its first token: the histograms saw every request, and the access log has its queue time.
    page = httpx.get(f"{server.url}/metrics").text
    for name in ("request_queue_time_seconds_count", "request_prefix_cache_hit_rate_count"):
        assert metric(page, f"jaxinfer:{name}") >= 2 * len(PROMPTS), name
    lines = [json.loads(line[line.index("{") :]) for line in server.log_tail(200_000).splitlines()
             if "jaxinfer.access" in line]  # fmt: skip
    assert len(lines) >= 2 * len(PROMPTS) and all(x["queue_time_s"] is not None for x in lines if x["status"] == 200)


def test_stop_string_found_on_the_api_side(server, reference):
    """A stop string ends every sample at it, though the core kept generating until it heard of it."""
    from jaxinfer import SamplingParams

    full = reference.generate(PROMPTS[2], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
                              use_tqdm=False)[0].outputs[0].text  # fmt: skip
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip(), full
    want = full[: full.index(stop)]
    with httpx.Client(base_url=server.url, timeout=60) as http:
        r = http.post("/v1/completions", json=_body(PROMPTS[2], max_tokens=24, n=2, stop=[stop]))
    assert r.status_code == 200, r.text
    choices = [(c["text"], c["finish_reason"], c["stop_reason"]) for c in r.json()["choices"]]
    assert choices == [(want, "stop", stop)] * 2


def test_concurrent_streams(server, reference):
    from jaxinfer import SamplingParams

    expected = [o.outputs[0].text for o in reference.generate(
        PROMPTS, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), use_tqdm=False)]  # fmt: skip

    async def main():
        limits = httpx.Limits(max_connections=40, max_keepalive_connections=40)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as c:
            return await asyncio.gather(*(_stream(c, _body(PROMPTS[i % 4])) for i in range(40)))

    results = asyncio.run(main())
    assert [(text, reason) for text, reason, _ in results] == [(expected[i % 4], "length") for i in range(40)]
    with httpx.Client(base_url=server.url, timeout=60) as http:
        deadline = time.monotonic() + 30
        while True:  # the core's stats reach /metrics with its next message
            metrics = http.get("/metrics").text
            if "jaxinfer:kv_cache_used_pages 0.0" in metrics or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    pages = SETTINGS["num_kv_tokens"] // 16  # pages of the default 16 tokens
    assert "jaxinfer:kv_cache_used_pages 0.0" in metrics and f"jaxinfer:kv_cache_total_pages {pages}.0" in metrics
    assert "jaxinfer:num_requests_in_flight 0.0" in metrics


def test_bad_requests_are_400(server, reference):
    from jaxinfer import SamplingParams

    with httpx.Client(base_url=server.url, timeout=60) as http:
        for body, param in [
            ({"prompt": [1, 49152], "max_tokens": 2}, "prompt"),
            ({"prompt": "hi", "max_tokens": 2, "logprobs": 21}, "logprobs"),
            ({"prompt": "hi", "max_tokens": 2, "logit_bias": {"49152": 1}}, "logit_bias"),
        ]:
            r = http.post("/v1/completions", json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        r = http.post("/v1/completions", json={"prompt": [1, 49152], "max_tokens": 2})
        with pytest.raises(ValueError) as e:
            reference.engine.validate([1, 49152], SamplingParams(max_tokens=2))
        assert r.json()["error"]["message"] == str(e.value)
        assert http.get("/health").status_code == 200


def test_sigterm_stops_the_core(server):
    """Runs last on the shared server: a clean shutdown stops the core process too."""
    pid = _core_pid(server)
    assert _running(pid)
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(60) == 0, server.log_tail()
    _wait_gone(pid, 5)
    assert "engine core process stopped (exit code 0)" in server.log_tail(20_000)


def test_killed_core_fails_streams_then_the_server_exits(tiny_model, tmp_path):
    srv = _start(tiny_model, tmp_path / "server.log")
    try:
        wait_ready(srv)
        pid = _core_pid(srv)

        async def main():
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as c:
                async with c.stream("POST", "/v1/completions", json=_body("Hello", max_tokens=120, stream=True)) as r:
                    lines = r.aiter_lines()
                    async for line in lines:
                        if line.startswith("data: "):
                            break  # a first token: the request is running in the core
                    os.kill(pid, signal.SIGKILL)
                    rest = [line[6:] async for line in lines if line.startswith("data: ")]
                # Right after the death: 503 for new work and for probes, until the server exits.
                late = await c.post("/v1/completions", json=_body("Hi"))
                health = await c.get("/health")
                return rest, late, health

        rest, late, health = asyncio.run(main())
        assert rest[-1] == "[DONE]"
        assert json.loads(rest[-2])["error"]["code"] == "engine_dead", rest[-3:]
        assert late.status_code == 503 and late.json()["error"]["code"] == "engine_dead", late.text
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
        assert srv.proc.wait(30) == 1, srv.log_tail()
        assert not _running(pid)
        assert "killed by SIGKILL" in srv.log_tail()
    finally:
        srv.stop()


def test_killed_server_takes_its_core_along(tiny_model, tmp_path):
    """SIGKILL gives the API server no chance to stop its core: the core sees its parent gone and exits."""
    srv = _start(tiny_model, tmp_path / "server.log")
    try:
        pid = _core_pid(srv)
        deadline = time.monotonic() + 60
        while "loaded in" not in srv.log_tail(100_000):  # the core is busy compiling
            assert time.monotonic() < deadline, srv.log_tail()
            time.sleep(0.05)
        srv.proc.kill()
        srv.proc.wait(10)
        _wait_gone(pid, 10)
    finally:
        srv.stop()


def test_a_server_that_cannot_listen_stops_its_core(tiny_model, tmp_path):
    """The core starts before the app is built (its start overlaps the app's imports): a server that then cannot
    listen (its port taken) exits with an error and stops that core, rather than leaving it loading for nobody."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        srv = _start(tiny_model, tmp_path / "server.log", "--port", str(taken.getsockname()[1]))
        try:
            pid = _core_pid(srv)
            assert srv.proc.wait(120) != 0, srv.log_tail()
            _wait_gone(pid, 30)
        finally:
            srv.stop()


@pytest.mark.parametrize(
    ("model", "says", "flags"),
    [("{tmp}/nowhere.gguf", "ModelNotFoundError: model path", ()),
     ("{tmp}/nowhere.gguf", "ModelNotFoundError: model path", ("--no-engine-process",)),  # loaded in the server's
     ("tests.model.byo_model:model", "--tokenizer NAME_OR_PATH", ())],  # a module of one's own, without a tokenizer
)  # fmt: skip
def test_a_model_that_cannot_load_is_named_in_one_line(tmp_path, model, says, flags):
    """A bad model path or setting is the user's error, not a bug: the server exits naming it in one line, as
    `jaxinfer generate` does. The engine process printed its traceback before that line; the tokenizer's advice was
    for the Python API only."""
    srv = start_server(tmp_path / "server.log", "--model", model.format(tmp=tmp_path), *flags)
    try:
        assert srv.proc.wait(120) == 1
    finally:
        srv.stop()
    log = srv.log_tail(100_000)
    errors = [line for line in log.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "exiting: loading the model failed" in errors[0] and says in errors[0], log
    assert "Traceback" not in log, log


def _bad_setting_build(args: dict):
    raise ValueError("injected bad setting")


def _buggy_build(args: dict):
    raise KeyError("injected bug")


@pytest.mark.parametrize(("build", "traceback"), [(_bad_setting_build, False), (_buggy_build, True)])
def test_only_a_bug_while_loading_prints_its_traceback(capfd, build, traceback):
    """The API side names either in its one line; the core adds the traceback of a bug (the same rule as the CLI's:
    jaxinfer.errors)."""
    from jaxinfer.engine.mp_engine import EngineLoadError, MPAsyncEngine
    from jaxinfer.server.args import ServerArgs

    engine = MPAsyncEngine(ServerArgs(model="fake"), build=build)
    try:
        with pytest.raises(EngineLoadError, match="injected"):
            engine.wait_ready(60)
    finally:
        engine.shutdown()
    assert ("Traceback" in capfd.readouterr().err) == traceback


class _FailingEngine(FakeEngine):
    """FakeEngine with what the core reports about an engine, raising in the step of a prompt ending in FAIL_TOKEN."""

    def __init__(self, vocab_size: int):
        super().__init__(vocab_size)
        from jaxinfer.config import ModelConfig

        self.cfg = ModelConfig(arch="llama", vocab_size=vocab_size, hidden_size=8, intermediate_size=8, num_layers=1,
                               num_heads=1, num_kv_heads=1, head_dim=8)  # fmt: skip
        self.allocator.page_size = 16
        self.eos_token_ids = ()
        self.num_prefilled_tokens = self.num_generated_tokens = self.num_steps = 0

    def add_request(self, prompt_ids, params, request_id: str) -> str:
        self.fail_next_step = self.fail_next_step or prompt_ids[-1] == FAIL_TOKEN
        return super().add_request(prompt_ids, params, request_id)


def _fake_build(args: dict):
    """Runs in the spawned core instead of loading a model."""
    from jaxinfer.model_files import smollm2_gguf
    from jaxinfer.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(smollm2_gguf())
    return _FailingEngine(tokenizer.vocab_size), tokenizer


def _deferring_build(args: dict):
    """A fake engine whose warm-up left programs to compile while idle, each taking a tenth of a second."""
    engine, tokenizer = _fake_build(args)
    compiled = type(engine.runner).compile_deferred

    def compile_deferred() -> int:
        time.sleep(0.1)
        return compiled(engine.runner)

    engine.runner.deferred = list(range(20))
    engine.runner.compile_deferred = compile_deferred
    return engine, tokenizer


def test_the_core_compiles_deferred_programs_while_idle_and_serves_meanwhile():
    """What a cold start left (ModelRunner.warmup(defer=True)) the core compiles between steps while idle, one at
    a time: a request meanwhile is served, and the count it reports for /metrics goes down to zero."""
    from jaxinfer import SamplingParams
    from jaxinfer.engine.mp_engine import MPAsyncEngine
    from jaxinfer.server.args import ServerArgs

    engine = MPAsyncEngine(ServerArgs(model="fake"), build=_deferring_build)
    try:
        engine.wait_ready(60)
        outs = asyncio.run(_drain(engine.generate([5, 6], SamplingParams(max_tokens=3), "meanwhile")))
        assert outs[-1].finished
        pending = [engine.stats().pending_compiles]
        deadline = time.monotonic() + 30
        while pending[-1] and time.monotonic() < deadline:
            time.sleep(0.02)
            pending.append(engine.stats().pending_compiles)
        assert pending[-1] == 0 and len(set(pending)) > 2, pending  # reported as it went down
    finally:
        engine.shutdown()


def test_engine_exception_fails_every_stream():
    """MPAsyncEngine without HTTP, on a fake core: outputs assembled here, an early close aborts in the core, and an
    exception in the core's step fails the waiting streams, calls on_death and ends the core with exit code 1."""
    from jaxinfer import SamplingParams
    from jaxinfer.engine.mp_engine import EngineDeadError, MPAsyncEngine
    from jaxinfer.engine.output import OutputAccumulator
    from jaxinfer.server.args import ServerArgs

    died = threading.Event()
    engine = MPAsyncEngine(ServerArgs(model="fake"), on_death=died.set, build=_fake_build)
    try:
        engine.wait_ready(60)

        async def main():
            whole = OutputAccumulator()
            for o in [o async for o in engine.generate([5, 6], SamplingParams(max_tokens=3, n=2), "ok")]:
                whole.add(o)
            assert [c.token_ids for c in whole.result().outputs] == [[7, 8, 9]] * 2 and whole.result().finished
            async for _ in engine.generate([5], SamplingParams(max_tokens=100), "left"):
                break  # closing the stream early aborts the request in the core
            deadline = time.monotonic() + 10
            while engine.stats().pages_used:  # the fake engine counts one page per live sequence
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            waiting = asyncio.ensure_future(_drain(engine.generate([5], SamplingParams(max_tokens=400), "waits")))
            with pytest.raises(EngineDeadError, match="injected engine failure"):
                await _drain(engine.generate([5, FAIL_TOKEN], SamplingParams(max_tokens=3), "fails"))
            with pytest.raises(EngineDeadError):
                await waiting
            with pytest.raises(EngineDeadError):
                await _drain(engine.generate([5], SamplingParams(), "late"))

        asyncio.run(main())
        assert died.wait(10) and not engine.alive
    finally:
        engine.shutdown()
    assert engine._proc.exitcode == 1


async def _drain(outputs) -> list:
    return [o async for o in outputs]
