"""Online serving benchmark: streams `/v1/completions` requests at an OpenAI-compatible server, like vLLM's
`benchmarks/benchmark_serving.py` (`vllm bench serve`), and reports TTFT, TPOT, ITL, end-to-end latency, throughput
and goodput with vLLM's definitions.

Run from the repository root:

    python -m benchmarks.bench_serving --base-url http://127.0.0.1:8000 --request-rate 1,4,inf   # a running server
    python -m benchmarks.bench_serving --launch jaxinfer --num-prompts 32 --out serving.json     # start serve.py
    python -m benchmarks.bench_serving --launch both --request-rate 1,4,inf --out both.json      # jaxinfer, then
        # llama-cpp-python's server on the same f32 weights and the same requests; ratios jaxinfer / llama.cpp
    python -m benchmarks.bench_serving --launch both --request-rate inf --max-concurrency 1,4,16  # concurrency sweep
    python -m benchmarks.bench_serving --quick --base-url URL                                    # seconds

Workload: `--num-prompts` random token-id prompts of `--input-len` tokens (ids drawn in [0, `--max-token-id`],
special tokens left out) with `--output-len` output tokens each (`--range-ratio` r: lengths uniform in
[L(1-r), L(1+r)], as vLLM's random dataset). Each prompt is made tokenizer-stable with the model's tokenizer
(decode, re-encode, repeat until `encode(decode(ids)) == ids`), so sending it as token ids (servers that accept
them, e.g. jaxinfer, vLLM) or as its text (e.g. llama-cpp-python's server) gives the server the same tokens.
Requests ask for `ignore_eos` (vLLM's name) and `min_tokens = max_tokens` (what llama-cpp-python honours), so every
request produces exactly `--output-len` tokens. Every (rate, concurrency) run gets its own prompts (same seed: the
same prompts for every server), so a prefix cache cannot reuse an earlier run's prompts.

Arrivals: Poisson at each `--request-rate` (gamma inter-arrival times with `--burstiness`, 1 = Poisson, as vLLM;
`inf` = all at once), optionally capped at `--max-concurrency` requests in flight (a request waits for a slot
before it is sent; its TTFT starts when it is sent, as vLLM). Runs = every concurrency x every rate.

See benchmarks/README.md for the metric definitions and the figures. A measurement tool, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from benchmarks.common import fill_defaults, format_table, host_metadata, int_list, load_avg, pyplot

REPO_ROOT = Path(__file__).resolve().parent.parent
PERCENTILES = (50, 90, 99)
METRICS = ("ttft", "tpot", "itl", "e2el")  # vLLM's names; e2el = end-to-end latency
GOODPUT_KEYS = ("ttft", "tpot", "e2el")
ENGINES = ("jaxinfer", "llamacpp", "llamacpp-quant")
# Higher is better for these; every other compared metric is a latency (lower is better).
THROUGHPUT_FIELDS = ("request_throughput", "output_throughput", "total_token_throughput", "request_goodput")

FULL_DEFAULTS: dict[str, Any] = dict(num_prompts=32, input_len=256, output_len=128, request_rate="inf",
                                     warmup_requests=2)  # fmt: skip
QUICK_DEFAULTS: dict[str, Any] = dict(num_prompts=6, input_len=16, output_len=8, request_rate="inf,20",
                                      warmup_requests=1)  # fmt: skip


# --- workload ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchRequest:
    prompt_ids: list[int]
    prompt_text: str | None  # None when no tokenizer was available: token-id prompts only
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


def stable_prompt(rng: random.Random, length: int, tokenizer: Any, max_token_id: int) -> tuple[list[int], str | None]:
    """`length` random token ids, made stable under the tokenizer: `encode(decode(ids)) == ids`, so the text and the
    ids are the same prompt. Without a tokenizer: the raw ids and no text."""
    ids: list[int] = []
    for _ in range(50):
        while len(ids) < length:
            t = rng.randint(0, max_token_id)
            if tokenizer is None or not tokenizer.is_special(t):
                ids.append(t)
        ids = ids[:length]
        if tokenizer is None:
            return ids, None
        text = tokenizer.decode(ids, skip_special_tokens=False)
        again = tokenizer.encode(text, add_special_tokens=False)
        if again == ids:
            return ids, text
        ids = again
    raise RuntimeError(f"no tokenizer-stable prompt of {length} tokens after 50 rounds")


def make_requests(
    n: int, input_len: int, output_len: int, range_ratio: float, seed: int, tag: str, tokenizer: Any,
    max_token_id: int,
) -> list[BenchRequest]:  # fmt: skip
    """vLLM's random dataset, tokenizer-stable: lengths uniform in [L(1-r), L(1+r)] (exactly L when r = 0). When the
    tokenizer adds BOS to text prompts, the ids start with BOS too (the server sees the same tokens either way)."""
    rng = random.Random(f"serving-{seed}-{tag}")
    bos = tokenizer.bos_token_id if tokenizer is not None and tokenizer.add_bos_token else None
    if tokenizer is not None:
        max_token_id = min(max_token_id, tokenizer.vocab_size - 1)

    def length(mean: int) -> int:
        return max(1, rng.randint(int(mean * (1 - range_ratio)), int(mean * (1 + range_ratio))))

    out = []
    for _ in range(n):
        p_len, o_len = length(input_len), length(output_len)
        ids, text = stable_prompt(rng, p_len - (bos is not None), tokenizer, max_token_id)
        out.append(BenchRequest(([bos] if bos is not None else []) + ids, text, o_len))
    return out


def arrival_offsets(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Send times (s after the start) of `n` requests: the first at 0, then gamma(burstiness, 1/(rate*burstiness))
    gaps (exponential, i.e. Poisson arrivals, at burstiness 1), as vLLM's `get_request`. rate inf: all at 0."""
    if math.isinf(rate):
        return [0.0] * n
    gaps = np.random.default_rng(seed).gamma(burstiness, 1.0 / (rate * burstiness), size=n)
    return [0.0, *np.cumsum(gaps[:-1]).tolist()][:n]


# --- client --------------------------------------------------------------------------------------------


@dataclass
class RequestResult:
    prompt_len: int
    max_tokens: int
    success: bool = False
    sent_at: float = 0.0  # s after the start of the run
    ttft: float = 0.0  # s from sending to the first chunk carrying text
    latency: float = 0.0  # s from sending to the last chunk carrying text (vLLM's e2el)
    itl: list[float] = field(default_factory=list)  # every gap between successive chunks carrying text
    output_tokens: int = 0
    token_source: str = ""  # "usage" (the server's completion_tokens) or "chunks" (counted text chunks)
    usage_prompt_tokens: int | None = None  # the server's count of the prompt, when it sends usage
    chunks: int = 0
    finish_reason: str | None = None
    error: str = ""


@dataclass
class Target:
    label: str
    base_url: str
    model: str | None = None
    prompt_format: str = "auto"
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def completions_url(self) -> str:
        return self.base_url.rstrip("/") + "/v1/completions"


def request_body(target: Target, req: BenchRequest, args: argparse.Namespace, stream: bool = True) -> dict[str, Any]:
    if target.prompt_format == "text":
        if req.prompt_text is None:
            raise ValueError("text prompts need a tokenizer (--tokenizer)")
        prompt: Any = req.prompt_text
    else:
        prompt = req.prompt_ids
    body: dict[str, Any] = dict(model=target.model, prompt=prompt, max_tokens=req.output_len,
                                temperature=float(args.temperature), stream=stream)  # fmt: skip
    if stream:
        body["stream_options"] = {"include_usage": True}
    if not args.allow_eos:
        body |= dict(ignore_eos=True, min_tokens=req.output_len)
    return body | args.extra_body


async def send_request(
    client: httpx.AsyncClient, target: Target, req: BenchRequest, args: argparse.Namespace, t0: float
) -> RequestResult:
    """One streamed completion, timed as vLLM's `async_request_openai_completions`."""
    res = RequestResult(prompt_len=req.prompt_len, max_tokens=req.output_len)
    body = request_body(target, req, args)
    usage_tokens: int | None = None
    last = st = time.perf_counter()
    res.sent_at = st - t0
    try:
        async with client.stream("POST", target.completions_url, json=body, headers=target.headers) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, SSE comments (pings)
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = f"in-band error: {json.dumps(chunk['error'])[:300]}"
                    return res
                choices = chunk.get("choices") or []
                if choices:
                    if choices[0].get("text"):
                        if res.chunks == 0:
                            res.ttft = now - st
                        else:
                            res.itl.append(now - last)
                        last = now
                        res.chunks += 1
                    res.finish_reason = choices[0].get("finish_reason") or res.finish_reason
                usage = chunk.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    usage_tokens = int(usage["completion_tokens"])
                    res.usage_prompt_tokens = usage.get("prompt_tokens")
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"[:300]
        return res
    if res.chunks == 0:
        res.error = "the stream carried no text"
        return res
    res.latency = last - st
    res.output_tokens, res.token_source = (
        (usage_tokens, "usage") if usage_tokens is not None else (res.chunks, "chunks")
    )
    res.success = True
    return res


def _client(args: argparse.Namespace) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout, connect=30.0), limits=limits)


async def run_benchmark(
    target: Target, reqs: list[BenchRequest], rate: float, max_concurrency: int | None, args: argparse.Namespace,
    seed: int,
) -> tuple[list[RequestResult], float]:  # fmt: skip
    """Sends `reqs` at their arrival times (at most `max_concurrency` in flight); returns the results in request
    order and the run's duration (start to the last request done), vLLM's `benchmark_duration`."""
    offsets = arrival_offsets(len(reqs), rate, args.burstiness, seed)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    async with _client(args) as client:
        t0 = time.perf_counter()

        async def one(req: BenchRequest, at: float) -> RequestResult:
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if sem is None:
                return await send_request(client, target, req, args, t0)
            async with sem:  # FIFO: waiting requests are sent in arrival order
                return await send_request(client, target, req, args, t0)

        results = await asyncio.gather(*(one(r, at) for r, at in zip(reqs, offsets, strict=True)))
        return list(results), time.perf_counter() - t0


async def detect_prompt_format(target: Target, req: BenchRequest, args: argparse.Namespace) -> tuple[str, str]:
    """The prompt format and why: "ids" when the server takes a token-id prompt (a 1-token, unstreamed probe
    answers 200), else "text" when it takes the same prompt as text (llama-cpp-python's server refuses a token-id
    list with HTTP 500 and a validation error, hence any error status, not only 4xx, moves on to text)."""
    probes = {}
    async with _client(args) as client:
        for fmt in ("ids", "text"):
            if fmt == "text" and req.prompt_text is None:
                break
            body = request_body(Target(target.label, target.base_url, target.model, fmt), req, args, stream=False)
            body["max_tokens"] = 1
            body.pop("min_tokens", None)
            r = await client.post(target.completions_url, json=body, headers=target.headers)
            if r.status_code == 200:
                counted = (r.json().get("usage") or {}).get("prompt_tokens")
                check = f"; the probe's prompt: {req.prompt_len} tokens sent, {counted} by the server's count"
                if fmt == "ids":
                    return "ids", "the server accepted a token-id prompt" + check
                return "text", f"token-id prompt refused ({probes['ids'][:100]}): sending text" + check
            probes[fmt] = f"HTTP {r.status_code}: {r.text[:160]}"
    raise RuntimeError(f"probe requests failed: {probes}")


def discover_model(target: Target, timeout: float = 30) -> str:
    r = httpx.get(target.base_url.rstrip("/") + "/v1/models", headers=target.headers, timeout=timeout)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


# --- metrics -------------------------------------------------------------------------------------------


def distribution(values_s: Sequence[float], name: str) -> dict[str, float]:
    """mean, median, std and percentiles (numpy's linear interpolation, as vLLM) in ms; 0 when empty (vLLM's `or 0`)."""
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    out = {f"mean_{name}_ms": 0.0, f"median_{name}_ms": 0.0, f"std_{name}_ms": 0.0}
    out |= {f"p{p}_{name}_ms": 0.0 for p in PERCENTILES}
    if ms.size:
        out |= {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
                f"std_{name}_ms": float(ms.std())}  # fmt: skip
        out |= {f"p{p}_{name}_ms": float(np.percentile(ms, p)) for p in PERCENTILES}
    return out


def request_tpot(r: RequestResult) -> float | None:
    """(e2el - ttft) / (output_tokens - 1); None for a single-token output (no decode time to divide)."""
    return (r.latency - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else None


def calculate_metrics(
    results: Sequence[RequestResult], duration_s: float, goodput: dict[str, float] | None = None
) -> dict[str, Any]:
    """vLLM's `calculate_metrics`: only successful requests count; TPOT per request from its own output length;
    ITL pools every request's gaps; goodput = requests meeting every SLO (ms; tpot of a 1-token output counts as 0)
    per second of the run."""
    ok = [r for r in results if r.success]
    tpots = [t for t in map(request_tpot, ok) if t is not None]
    m: dict[str, Any] = dict(
        requests=len(results), completed=len(ok), failed=len(results) - len(ok), duration_s=duration_s,
        total_input_tokens=sum(r.prompt_len for r in ok), total_output_tokens=sum(r.output_tokens for r in ok),
    )  # fmt: skip
    m["request_throughput"] = len(ok) / duration_s
    m["output_throughput"] = m["total_output_tokens"] / duration_s
    m["total_token_throughput"] = (m["total_input_tokens"] + m["total_output_tokens"]) / duration_s
    m["request_goodput"] = m["good_requests"] = None
    if goodput:
        seconds = {k: v / 1000.0 for k, v in goodput.items()}
        good = 0
        for r in ok:
            value = dict(ttft=r.ttft, tpot=request_tpot(r) or 0.0, e2el=r.latency)
            good += all(value[k] <= slo for k, slo in seconds.items())
        m["good_requests"], m["request_goodput"] = good, good / duration_s
    m |= distribution([r.ttft for r in ok], "ttft")
    m |= distribution(tpots, "tpot")
    m |= distribution([g for r in ok for g in r.itl], "itl")
    m |= distribution([r.latency for r in ok], "e2el")
    m["max_in_flight"] = max_in_flight(ok)
    m["token_source"] = {s: sum(r.token_source == s for r in ok) for s in sorted({r.token_source for r in ok})}
    m["short_outputs"] = sum(r.output_tokens < r.max_tokens for r in ok)
    # Requests whose prompt the server counted differently (a text prompt that did not tokenize as intended).
    m["prompt_len_mismatches"] = sum(r.usage_prompt_tokens not in (None, r.prompt_len) for r in ok)
    return m


def max_in_flight(results: Sequence[RequestResult]) -> int:
    """Most requests between sending and their last token at once (ends before starts at equal times)."""
    events = sorted([(r.sent_at, 1) for r in results] + [(r.sent_at + r.latency, -1) for r in results],
                    key=lambda e: (e[0], e[1]))  # fmt: skip
    peak = cur = 0
    for _, d in events:
        cur += d
        peak = max(peak, cur)
    return peak


def parse_goodput(items: Sequence[str] | None) -> dict[str, float] | None:
    """vLLM's `--goodput ttft:500 tpot:50` (ms)."""
    if not items:
        return None
    out = {}
    for item in items:
        key, sep, value = item.partition(":")
        if not sep or key not in GOODPUT_KEYS:
            raise argparse.ArgumentTypeError(f"--goodput: expected KEY:MS with KEY in {GOODPUT_KEYS}, got {item!r}")
        try:
            out[key] = float(value)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"--goodput: {item!r}: {value!r} is not a number of ms") from e
        if out[key] <= 0:
            raise argparse.ArgumentTypeError(f"--goodput: {item!r}: the SLO must be > 0 ms")
    return out


# --- launched servers ----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pending_compilations(url: str, headers: dict[str, str] | None = None) -> float:
    """jaxinfer's count of step programs a cold start still compiles while idle (0 for another server)."""
    text = httpx.get(f"{url}/metrics", headers=headers, timeout=5).text
    m = re.search(r"^jaxinfer:engine_pending_compilations (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


class LaunchedServer:
    """A server in a child process (own session, so a Ctrl-C here reaches only this process, whose `finally`
    stops it), its output in a log file; ready once GET /v1/models answers 200 and, for jaxinfer, once the step
    variants a cold start compiles while idle are compiled too (they would run inside the timed load)."""

    def __init__(self, label: str, cmd: list[str], port: int, log_path: Path, env: dict[str, str] | None = None):
        self.label, self.cmd, self.log_path = label, cmd, log_path
        self.url = f"http://127.0.0.1:{port}"
        self._log = log_path.open("w")
        self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)  # fmt: skip
        self.t0 = time.monotonic()
        self.ready_s: float | None = None

    def log_tail(self, n: int = 2000) -> str:
        return self.log_path.read_text(errors="replace")[-n:]

    def wait_ready(self, timeout: float, headers: dict[str, str] | None = None, poll: float = 0.5) -> float:
        """Seconds from launch until ready (GET /v1/models 200), polled every `poll` s; returns once the pending
        compilations are done too."""
        while time.monotonic() - self.t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.label} server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/v1/models", headers=headers, timeout=5).status_code == 200:
                    self.ready_s = time.monotonic() - self.t0
                    while time.monotonic() - self.t0 < timeout and pending_compilations(self.url, headers):
                        time.sleep(poll)
                    return self.ready_s
            except httpx.TransportError:
                pass
            time.sleep(poll)
        raise TimeoutError(f"{self.label} server not ready after {timeout:.0f}s:\n{self.log_tail()}")

    def stop(self, timeout: float = 60) -> int | None:
        """SIGTERM (both servers drain and exit on it), then SIGKILL after `timeout` s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode


def jaxinfer_command(args: argparse.Namespace, port: int, max_model_len: int) -> list[str]:
    """serve.py with a KV pool for `--max-num-seqs` full-length sequences (nothing is preempted), as bench_offline.
    `--jaxinfer-args` come last, so they override these."""
    return [
        sys.executable, str(REPO_ROOT / "serve.py"), "--model", args.model, "--host", "127.0.0.1", "--port", str(port),
        "--max-model-len", str(max_model_len), "--max-num-seqs", str(args.max_num_seqs),
        "--num-kv-tokens", str(args.max_num_seqs * max_model_len), *shlex.split(args.jaxinfer_args),
    ]  # fmt: skip


def llamacpp_command(args: argparse.Namespace, port: int, n_ctx: int, gguf: Path) -> list[str]:
    """llama-cpp-python's server: one Llama (one sequence: requests are served one at a time, behind a lock, and
    `interrupt_requests` off so a new request waits instead of cutting the stream in progress), all cores for
    prompt and generation, an f32 KV cache (as jaxinfer's) unless `--llamacpp-kv f16`."""
    kv = {"f32": "0", "f16": "1"}[args.llamacpp_kv]
    return [
        args.llamacpp_python, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1",
        "--port", str(port), "--n_threads", str(args.threads), "--n_threads_batch", str(args.threads),
        "--n_ctx", str(n_ctx), "--n_batch", "512", "--type_k", kv, "--type_v", kv, "--interrupt_requests", "False",
        "--verbose", "False", *shlex.split(args.llamacpp_args),
    ]  # fmt: skip


def launch(
    engine: str, args: argparse.Namespace, max_model_len: int, log_dir: Path, notes: list[str]
) -> LaunchedServer:
    port = free_port()
    if engine == "jaxinfer":
        cmd = jaxinfer_command(args, port, max_model_len)
    else:
        from benchmarks import references
        from jaxinfer.model_files import resolve_model_path

        if args.llamacpp_python == sys.executable and (why := references.llama_cpp_missing()):
            raise RuntimeError(why)
        path = resolve_model_path(args.model)
        if path.suffix != ".gguf":
            raise RuntimeError(f"llama.cpp needs a GGUF model file, got {path}")
        if engine == "llamacpp":
            path = references.f32_gguf(path)  # the same dequantized weights jaxinfer loads
        n_ctx = -(-max_model_len // 256) * 256
        cmd = llamacpp_command(args, port, n_ctx, path)
        probe = "import llama_cpp; print(llama_cpp.__version__, llama_cpp.__file__)"
        which = subprocess.run([args.llamacpp_python, "-c", probe], capture_output=True, text=True, check=False)
        notes.append(f"{engine}: {path.name}, n_ctx {n_ctx}, {args.threads} threads, KV {args.llamacpp_kv}; "
                     f"llama-cpp-python {which.stdout.strip() or '?'}")  # fmt: skip
    print(f"{engine}: starting {shlex.join(cmd)}", flush=True)
    srv = LaunchedServer(engine, cmd, port, log_dir / f"{engine}.log")
    try:
        ready = srv.wait_ready(args.startup_timeout, _auth(args))
    except BaseException:
        srv.stop()
        raise
    print(f"{engine}: ready in {ready:.1f}s (log {srv.log_path})", flush=True)
    return srv


def _auth(args: argparse.Namespace) -> dict[str, str]:
    return {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}


# --- one server: every run -----------------------------------------------------------------------------


def run_label(rate: float, conc: int | None) -> str:
    r = "inf" if math.isinf(rate) else f"{rate:g}"
    return f"rate={r}" + (f",conc={conc}" if conc else "")


def bench_target(
    target: Target,
    runs: list[tuple[float, int | None]],
    workloads: list[list[BenchRequest]],
    warmup: list[BenchRequest],
    args: argparse.Namespace,
    notes: list[str],
) -> list[dict[str, Any]]:
    target.model = args.served_model_name or discover_model(target)
    first = (warmup or workloads[0])[0]
    if target.prompt_format == "auto":
        target.prompt_format, why = asyncio.run(detect_prompt_format(target, first, args))
        notes.append(f"{target.label}: prompt format {target.prompt_format} ({why})")
        print(f"{target.label}: prompts as {target.prompt_format} ({why})", flush=True)
    if warmup:
        t0 = time.perf_counter()
        res, _ = asyncio.run(run_benchmark(target, warmup, math.inf, None, args, args.seed))
        bad = [r.error for r in res if not r.success]
        if bad:
            raise RuntimeError(f"{target.label}: warm-up request failed: {bad[0]}")
        print(f"{target.label}: warm-up ({len(warmup)} requests) {time.perf_counter() - t0:.1f}s", flush=True)
    rows = []
    for i, ((rate, conc), reqs) in enumerate(zip(runs, workloads, strict=True)):
        load0 = load_avg()
        results, duration = asyncio.run(run_benchmark(target, reqs, rate, conc, args, args.seed + i))
        m = calculate_metrics(results, duration, args.goodput)
        row = dict(engine=target.label, run=run_label(rate, conc), request_rate=rate, max_concurrency=conc,
                   prompt_format=target.prompt_format, model=target.model, **m)  # fmt: skip
        row["load_avg"] = [load0, load_avg()]
        errors = [r.error for r in results if not r.success]
        if errors:
            row["errors"] = sorted(set(errors))[:5]
            notes.append(f"{target.label} {row['run']}: {len(errors)} failed requests, e.g. {errors[0]}")
        if m["prompt_len_mismatches"]:
            notes.append(f"{target.label} {row['run']}: the server counted {m['prompt_len_mismatches']} prompts "
                         "at another length than sent")  # fmt: skip
        if m["short_outputs"]:
            notes.append(f"{target.label} {row['run']}: {m['short_outputs']} requests counted fewer output tokens "
                         f"than max_tokens (token source {m['token_source']})")  # fmt: skip
        if args.save_detailed:
            row["detailed"] = [asdict(r) for r in results]
        rows.append(row)
        print(f"{target.label} {row['run']}: {m['completed']}/{m['requests']} ok in {duration:.1f}s, "
              f"{m['output_throughput']:.1f} out tok/s, TTFT p50 {m['median_ttft_ms']:.0f} ms, "
              f"TPOT p50 {m['median_tpot_ms']:.1f} ms, E2E p50 {m['median_e2el_ms']:.0f} ms", flush=True)  # fmt: skip
    return rows


# --- ratios, tables, plot ------------------------------------------------------------------------------

RATIO_FIELDS = (*THROUGHPUT_FIELDS, *(f"{s}_{m}_ms" for m in METRICS for s in ("mean", "median", "p90", "p99")))


def ratios(rows: list[dict[str, Any]], base: str = "jaxinfer") -> list[dict[str, Any]]:
    """base / other for every other engine and run: > 1 means the base is faster on throughputs, slower on
    latencies."""
    by = {(r["engine"], r["run"]): r for r in rows}
    out = []
    for r in rows:
        b = by.get((base, r["run"]))
        if r["engine"] == base or b is None:
            continue
        vals = {}
        for f in RATIO_FIELDS:
            x, y = b.get(f), r.get(f)
            vals[f] = x / y if x is not None and y else None
        out.append(dict(run=r["run"], engines=f"{base}/{r['engine']}", **vals))
    return out


def _ms(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}"


def _x(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


SUMMARY_COLS = [("req/s", "request_throughput", "{:.2f}"), ("out_tok/s", "output_throughput", "{:.1f}"),
                ("tot_tok/s", "total_token_throughput", "{:.1f}"), ("goodput", "request_goodput", "{:.2f}")] + [
    (f"{lab}_{p}", f"{p if p != 'p50' else 'median'}_{m}_ms", "ms")
    for m, lab in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E")) for p in ("p50", "p99")
]  # fmt: skip


def summary_table(rows: list[dict[str, Any]], rat: list[dict[str, Any]], goodput: bool) -> str:
    cols = [c for c in SUMMARY_COLS if goodput or c[1] != "request_goodput"]
    headers = ["run", "engine", "prompt", "ok", "dur_s", *(c[0] for c in cols)]
    body = []
    for run in dict.fromkeys(r["run"] for r in rows):
        for r in (r for r in rows if r["run"] == run):
            cells = [_ms(r[f]) if fmt == "ms" else ("-" if r[f] is None else fmt.format(r[f])) for _, f, fmt in cols]
            body.append([run, r["engine"], r["prompt_format"], f"{r['completed']}/{r['requests']}",
                         f"{r['duration_s']:.1f}", *cells])  # fmt: skip
        for q in (q for q in rat if q["run"] == run):
            body.append([run, q["engines"], "", "", "", *(_x(q[f]) for _, f, _ in cols)])
    return format_table(headers, body)


def latency_table(rows: list[dict[str, Any]], rat: list[dict[str, Any]]) -> str:
    headers = ["run", "engine", "metric", "mean_ms", "p50_ms", "p90_ms", "p99_ms", "std_ms"]
    body = []
    for run in dict.fromkeys(r["run"] for r in rows):
        for m in METRICS:
            for r in (r for r in rows if r["run"] == run):
                body.append([run, r["engine"], m.upper(), *(_ms(r[f"{s}_{m}_ms"])
                             for s in ("mean", "median", "p90", "p99", "std"))])  # fmt: skip
            for q in (q for q in rat if q["run"] == run):
                body.append([run, q["engines"], m.upper(),
                             *(_x(q[f"{s}_{m}_ms"]) for s in ("mean", "median", "p90", "p99")), ""])  # fmt: skip
    return format_table(headers, body)


def write_plot(rows: list[dict[str, Any]], path: Path, title: str) -> str:
    plt = pyplot()
    if plt is None:
        return "matplotlib is not installed: no plot (pip install matplotlib)"
    runs = list(dict.fromkeys(r["run"] for r in rows))
    engines = list(dict.fromkeys(r["engine"] for r in rows))
    panels = [("output_throughput", "output tokens / s"), ("median_ttft_ms", "TTFT p50 (ms)"),
              ("median_tpot_ms", "TPOT p50 (ms)"), ("median_e2el_ms", "E2E latency p50 (ms)")]  # fmt: skip
    fig, axes = plt.subplots(2, 2, figsize=(max(8, 1.4 * len(runs) * len(engines) ** 0.5 + 4), 7))
    width = 0.8 / len(engines)
    for ax, (key, ylabel) in zip(axes.flat, panels, strict=True):
        for k, eng in enumerate(engines):
            vals = {r["run"]: r[key] for r in rows if r["engine"] == eng}
            xs = [i + (k - (len(engines) - 1) / 2) * width for i in range(len(runs))]
            ax.bar(xs, [vals.get(run, 0.0) for run in runs], width, label=eng)
        ax.set_xticks(range(len(runs)), runs, fontsize=7, rotation=20)
        ax.set_ylabel(ylabel, fontsize=8)
        if key == "median_ttft_ms":
            ax.set_yscale("log")  # queueing makes TTFT span orders of magnitude across rates
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"wrote {path}"


# --- CLI -----------------------------------------------------------------------------------------------


def rate_list(text: str) -> list[float]:
    """A comma list of request rates (requests/s, > 0) or inf."""
    try:
        vals = [float(x) for x in str(text).split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--request-rate: expected numbers or inf, got {text!r}") from e
    if not vals or min(vals) <= 0 or any(math.isnan(v) for v in vals):
        raise argparse.ArgumentTypeError(f"--request-rate: expected rates > 0 or inf, got {text!r}")
    return vals


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_serving", description=__doc__.split("\n")[0])
    where = p.add_mutually_exclusive_group()
    where.add_argument("--base-url", help="a running OpenAI-compatible server, e.g. http://127.0.0.1:8000")
    where.add_argument("--launch", help="start and benchmark servers in turn: jaxinfer, llamacpp, llamacpp-quant "
                                        "(comma list), or both (= jaxinfer,llamacpp)")  # fmt: skip
    p.add_argument("--label", default="server", help="engine name in the tables for --base-url")
    p.add_argument("--model", default="smollm2-135m-instruct", help="model for launched servers (preset or path)")
    p.add_argument("--tokenizer", help="tokenizer for the prompts (default: --model's); 'none': raw ids, no text")
    p.add_argument("--served-model-name", help="the request's `model` field (default: the first of /v1/models)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer token (default $OPENAI_API_KEY)")
    for flag, typ, text in [
        ("--num-prompts", int, "requests per run"),
        ("--input-len", int, "prompt tokens per request"),
        ("--output-len", int, "output tokens per request"),
        ("--request-rate", str, "comma list of requests/s (Poisson), inf = all at once"),
        ("--warmup-requests", int, "untimed requests (sent at once, up to 32 output tokens) before the runs"),
    ]:
        name = flag[2:].replace("-", "_")
        alias = [f"--random-{flag[2:]}"] if flag in ("--input-len", "--output-len") else []
        p.add_argument(flag, *alias, type=typ, dest=name,
                       help=f"{text} (default {FULL_DEFAULTS[name]}; --quick {QUICK_DEFAULTS[name]})")  # fmt: skip
    p.add_argument("--range-ratio", "--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [L(1-r), L(1+r)] (default 0: exact)")  # fmt: skip
    p.add_argument("--max-token-id", type=int, default=10000, help="prompt ids drawn in [0, this] (as bench_offline)")
    p.add_argument("--prompt-format", choices=["auto", "ids", "text"], default="auto",
                   help="auto: token ids when the server accepts them, else text")  # fmt: skip
    p.add_argument("--max-concurrency", type=int_list, help="comma list: requests in flight at most (a sweep)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the inter-arrival times (1: Poisson)")
    p.add_argument("--goodput", nargs="+", metavar="KEY:MS", help="SLOs, e.g. ttft:500 tpot:50 (keys ttft, tpot, e2el)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--allow-eos", action="store_true", help="do not ask for ignore_eos / min_tokens")
    p.add_argument("--extra-body", type=json.loads, default={}, help="JSON merged into every request body")
    p.add_argument("--request-timeout", type=float, default=1800.0, help="s per request (read timeout)")
    p.add_argument("--startup-timeout", type=float, default=1800.0, help="s for a launched server to get ready")
    p.add_argument("--max-num-seqs", type=int, default=32, help="jaxinfer: --max-num-seqs (KV pool: this many full "
                                                                "sequences)")  # fmt: skip
    p.add_argument("--max-model-len", type=int, help="launched servers' context (default: longest request, rounded)")
    p.add_argument("--jaxinfer-args", default="", help="more serve.py flags (last: they override)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama.cpp threads (default: all cores)")
    p.add_argument("--llamacpp-kv", choices=["f32", "f16"], default="f32", help="llama.cpp KV cache type")
    p.add_argument("--llamacpp-args", default="", help="more llama_cpp.server flags")
    p.add_argument("--llamacpp-python", default=sys.executable,
                   help="python that runs llama_cpp.server (e.g. a venv with a rebuilt wheel)")  # fmt: skip
    p.add_argument("--log-dir", help="launched servers' logs (default: a temp dir, kept)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-detailed", action="store_true", help="per-request results in the JSON")
    p.add_argument("--quick", action="store_true", help="tiny workload: a seconds-long run")
    p.add_argument("--out", help="write the results as JSON here (and the plot beside it, .png)")
    p.add_argument("--plot", help="PNG path for the plot (default: --out with .png)")
    args = p.parse_args(argv)

    fill_defaults(args, QUICK_DEFAULTS, FULL_DEFAULTS)
    try:
        args.request_rate = rate_list(args.request_rate)
        args.goodput = parse_goodput(args.goodput)
    except argparse.ArgumentTypeError as e:
        p.error(str(e))
    if args.base_url is None and args.launch is None:
        p.error("give --base-url URL (a running server) or --launch ENGINES")
    if args.launch is not None:
        names = ["jaxinfer", "llamacpp"] if args.launch == "both" else [x for x in args.launch.split(",") if x]
        if not names or set(names) - set(ENGINES):
            p.error(f"--launch: expected a comma list of {ENGINES} or both, got {args.launch!r}")
        args.launch = list(dict.fromkeys(names))
    for name in ("num_prompts", "input_len", "output_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 <= args.range_ratio < 1:
        p.error("--range-ratio must be in [0, 1)")
    if args.burstiness <= 0:
        p.error("--burstiness must be > 0")
    if not isinstance(args.extra_body, dict):
        p.error("--extra-body must be a JSON object")
    return args


def load_prompt_tokenizer(args: argparse.Namespace, notes: list[str]) -> Any:
    if args.tokenizer == "none":
        return None
    from jaxinfer.model_files import resolve_model_path
    from jaxinfer.tokenizer import load_tokenizer

    try:
        return load_tokenizer(resolve_model_path(args.tokenizer or args.model))
    except Exception as e:  # a server's model this machine has no files for: ids only
        notes.append(f"no tokenizer ({type(e).__name__}: {e}): raw token-id prompts, no text prompts")
        return None


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    meta = host_metadata("benchmarks.bench_serving", args, argv)
    print(f"{meta['date']}, {meta['host']['cpu_count']} CPUs ({meta['host']['cpu_model']}), "
          f"load average {meta['load_avg_start']}", flush=True)  # fmt: skip
    notes: list[str] = []
    tokenizer = load_prompt_tokenizer(args, notes)
    concs: list[int | None] = list(args.max_concurrency) if args.max_concurrency else [None]
    runs = [(rate, conc) for conc in concs for rate in args.request_rate]
    mk = dict(input_len=args.input_len, output_len=args.output_len, range_ratio=args.range_ratio, seed=args.seed,
              tokenizer=tokenizer, max_token_id=args.max_token_id)  # fmt: skip
    workloads = [make_requests(args.num_prompts, tag=f"run{i}", **mk) for i in range(len(runs))]
    warm = make_requests(args.warmup_requests, tag="warmup", **mk)
    warm = [BenchRequest(r.prompt_ids, r.prompt_text, min(r.output_len, 32)) for r in warm]
    longest = max(r.prompt_len + r.output_len for w in workloads for r in w)
    max_model_len = args.max_model_len or -(-(longest + 1) // 16) * 16
    p_tok = sum(r.prompt_len for r in workloads[0])
    o_tok = sum(r.output_len for r in workloads[0])
    print(f"workload per run: {args.num_prompts} requests, {p_tok:,} prompt + {o_tok:,} output tokens; runs: "
          f"{', '.join(run_label(*r) for r in runs)}", flush=True)  # fmt: skip

    rows: list[dict[str, Any]] = []
    servers: dict[str, Any] = {}
    if args.base_url:
        target = Target(args.label, args.base_url, prompt_format=args.prompt_format, headers=_auth(args))
        rows += bench_target(target, runs, workloads, warm, args, notes)
    else:
        log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="bench_serving_"))
        log_dir.mkdir(parents=True, exist_ok=True)
        for engine in args.launch:
            try:
                srv = launch(engine, args, max_model_len, log_dir, notes)
            except Exception as e:
                notes.append(f"{engine}: FAILED to start: {str(e)[:400]}")
                print(f"note: {notes[-1]}", flush=True)
                continue
            try:
                target = Target(engine, srv.url, prompt_format=args.prompt_format, headers=_auth(args))
                rows += bench_target(target, runs, workloads, warm, args, notes)
            except Exception as e:
                notes.append(f"{engine}: FAILED: {type(e).__name__}: {str(e)[:400]}")
                print(f"note: {notes[-1]}\n{srv.log_tail(1500)}", flush=True)
            finally:
                rc = srv.stop()
                servers[engine] = dict(command=shlex.join(srv.cmd), ready_s=srv.ready_s, exit_code=rc,
                                       log=str(srv.log_path))  # fmt: skip
                print(f"{engine}: stopped (exit code {rc})", flush=True)

    rat = ratios(rows, "jaxinfer") if args.launch and "jaxinfer" in args.launch else []
    meta["load_avg_end"] = load_avg()
    meta["max_model_len"] = max_model_len
    meta["versions"] = _versions()
    if rows:
        print("\n== serving throughput and latency percentiles (ms); ratio rows: jaxinfer / other engine "
              "(> 1: jaxinfer higher; for throughputs higher is better, for latencies lower is better)")  # fmt: skip
        print(summary_table(rows, rat, args.goodput is not None))
        print("\n== latency distributions (ms; TPOT per request = (E2E - TTFT) / (output tokens - 1); ITL: every gap "
              "between streamed chunks carrying text)")  # fmt: skip
        print(latency_table(rows, rat))
    for note in notes:
        print(f"note: {note}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, servers=servers, rows=rows, ratios=rat, notes=notes), f, indent=1)
        print(f"\nwrote {args.out}")
    plot = args.plot or (str(Path(args.out).with_suffix(".png")) if args.out else None)
    if plot and rows:
        title = f"{args.model if args.launch else args.base_url}, {args.num_prompts} x {args.input_len}/" \
                f"{args.output_len} tokens, {meta['host']['cpu_count']} CPUs, {meta['date'][:10]}"  # fmt: skip
        print(write_plot(rows, Path(plot), title))
    return 0 if rows and all(r["failed"] == 0 for r in rows) else 1


def _versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {}
    for pkg in ("jax", "jaxlib", "httpx", "llama_cpp_python"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


if __name__ == "__main__":
    sys.exit(main())
