"""Host overhead: how long the device waits for the host between steps, with overlap scheduling on and off.

Run from the repository root:

    python -m benchmarks.bench_host --out host.json                     # SmolLM2, batches 1,32,256, offline + HTTP
    python -m benchmarks.bench_host --shape qwen3-0.6b --sections offline   # random weights (GPU runs)
    python -m benchmarks.bench_host --quick                             # seconds (the smoke test)

Sections:
- `offline`: `LLM.generate` (tokenizer and incremental detokenizer included; `Engine` + `OutputProcessor` for
  random-weight `--shape` models) of B requests that decode together, with overlap scheduling on and off. Every
  step is timestamped by `jaxinfer.engine.timeline.StepTimeline`: when the host began preparing it, when its
  launch returned, when the device had its outputs. Over the steady decode steps it reports the device's busy time
  per step, the host's preparation time, the idle gap before each step and idle / (idle + busy), and the wall time
  per step against the bare compiled step replayed with the same inputs (`bench_latency.bare_step`):
  `engine/bare` is what the engine adds that a user can see (goal: <= 1.10 at batch 1 and 64).
- `http`: the same kind of workload as `--http-streams` concurrent streaming requests through `python serve.py`
  (engine core in its own process), against `LLM.generate` of the same requests in this process: output tok/s
  and their ratio (goal: >= 0.9), plus the server's device idle share from its /metrics timeline.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from benchmarks.bench_latency import bare_step, capture_steps, recordable
from benchmarks.common import fill_defaults, format_table, int_list, load_avg, metadata, random_params, shape_config

FULL_DEFAULTS: dict[str, Any] = dict(batch="1,32,256", prompt_len=32, steps=48, warmup_steps=8, bare_iters=20,
                                     prefill_tokens=1024)  # fmt: skip
# 16 prefill tokens a step: the quick run's 4 x 8-token prompts in two steps, and one mixed-step bucket to compile
# instead of seven (a cold smoke test spent 30 of its 40 s compiling the buckets of 32 to 1024 + 4 tokens).
QUICK_DEFAULTS: dict[str, Any] = dict(batch="1,4", prompt_len=8, steps=6, warmup_steps=2, bare_iters=3,
                                      prefill_tokens=16)  # fmt: skip


def build(args: argparse.Namespace, max_seqs: int, overlap: bool) -> tuple[Any, Any]:
    """(engine, tokenizer or None) sized for `max_seqs` rows of prompt_len + warmup + steps tokens."""
    from jaxinfer.engine.config import CacheConfig
    from jaxinfer.engine.engine import Engine

    seq_len = args.prompt_len + decode_tokens(args, max_seqs) + 8
    page = 16
    max_len = -(-seq_len // page) * page
    cache = CacheConfig(block_size=page, num_pages=max_seqs * (max_len // page) + 8, max_model_len=max_len,
                        max_num_seqs=max_seqs, max_num_batched_tokens=max_seqs + args.prefill_tokens,
                        enable_prefix_caching=False)  # fmt: skip
    if args.shape:
        cfg = shape_config(args.shape, args.dtype or "bfloat16")
        return recordable(Engine(cfg, random_params(cfg, seed=0), cache, (), args.attn_impl, 0, overlap=overlap)), None
    from jaxinfer.weights import load_model

    loaded = _MODELS.get(args.model) or _MODELS.setdefault(args.model, load_model(args.model, dtype=args.dtype))
    eng = Engine(loaded.config, loaded.params, cache, (), args.attn_impl, 0, overlap=overlap)
    return recordable(eng), loaded.tokenizer


_MODELS: dict[str, Any] = {}


def decode_tokens(args: argparse.Namespace, batch: int) -> int:
    """max_tokens per request. The prompts are prefilled over several steps (the token budget), and a row starts
    decoding as soon as its prompt is in, so rows run up to that many steps apart: every row decodes together
    for `warmup_steps + steps` steps only if each asks for that many more."""
    prefill_steps = -(-batch * args.prompt_len // args.prefill_tokens)
    return args.warmup_steps + args.steps + prefill_steps


def run_loop(engine: Any, tokenizer: Any, prompts: list[list[int]], max_tokens: int) -> float:
    """What `LLM.generate` does (engine steps + detokenization + stop checks), on `engine`; returns seconds."""
    from jaxinfer.engine.output import OutputProcessor
    from jaxinfer.types import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    proc = OutputProcessor(tokenizer) if tokenizer is not None else None
    t0 = time.perf_counter()
    for p in prompts:
        rid = engine.add_request(p, sp)
        if proc is not None:
            proc.add(rid, None, p, sp)
    while engine.has_unfinished():
        updates = engine.step()
        if proc is not None:
            proc.process(updates, engine.finish_sequence)
    return time.perf_counter() - t0


def bench_offline(args: argparse.Namespace, batch: int, overlap: bool) -> dict[str, Any]:
    from jaxinfer.engine.runner import compile_count
    from jaxinfer.engine.timeline import StepTimeline

    engine, tok = build(args, batch, overlap)
    engine.runner.warmup(advanced=False)
    rng = np.random.default_rng(0)
    vocab = min(engine.cfg.vocab_size, tok.vocab_size if tok is not None else engine.cfg.vocab_size)
    prompts = [rng.integers(0, vocab, args.prompt_len).tolist() for _ in range(batch)]
    run_loop(engine, tok, prompts[:1], 2)  # one short request: everything host-side is warm too
    engine.runner.timeline = timeline = StepTimeline()
    c0 = compile_count()
    with capture_steps() as calls:
        elapsed = run_loop(engine, tok, prompts, decode_tokens(args, batch))
    compiles = compile_count() - c0
    # Only the steps that decode every row (the timeline's records and the captured calls are the same steps).
    s = timeline.summary(kind="decode", skip=args.warmup_steps, num_seqs=batch)
    full = [i for i, rec in enumerate(timeline.steps) if rec.kind == "decode" and rec.num_seqs == batch]
    if len(timeline.steps) != len(calls) or not full:
        raise RuntimeError(f"B={batch}: {len(full)} decode steps with every row ({len(calls)} steps captured)")
    # The last full decode step, replayed bare: the same program and inputs, nothing of the engine around it.
    bare = bare_step(engine, calls[full[-1]])
    bare()
    samples = []
    for _ in range(args.bare_iters):
        t0 = time.perf_counter()
        bare()
        samples.append(time.perf_counter() - t0)
    bare_ms = statistics.median(samples) * 1e3
    return dict(
        batch=batch, overlap=overlap, elapsed_s=elapsed,
        output_tok_s=batch * decode_tokens(args, batch) / elapsed, compiles=compiles, bare_ms=bare_ms,
        engine_over_bare=s.get("step_ms", float("nan")) / bare_ms, **s,
    )  # fmt: skip


def offline_table(rows: list[dict[str, Any]]) -> str:
    headers = ["B", "overlap", "step_ms", "bare_ms", "engine/bare", "device_ms", "host_ms", "idle_ms", "idle%",
               "out tok/s", "compiles"]  # fmt: skip
    body = [
        [str(r["batch"]), "on" if r["overlap"] else "off", f"{r['step_ms']:.2f}", f"{r['bare_ms']:.2f}",
         f"{r['engine_over_bare']:.3f}", f"{r['device_ms']:.2f}", f"{r['host_ms']:.2f}", f"{r['idle_ms']:.2f}",
         f"{r['idle_share']:.1%}", f"{r['output_tok_s']:.1f}", str(r["compiles"])]
        for r in rows
    ]  # fmt: skip
    return format_table(headers, body)


def _http_settings(args: argparse.Namespace) -> dict[str, int]:
    seqs = min(args.http_streams, 256)
    max_len = -(-(args.prompt_len + args.http_max_tokens + 8) // 16) * 16
    return dict(max_model_len=max_len, max_num_seqs=seqs, num_kv_tokens=seqs * max_len,
                max_num_batched_tokens=max(256, seqs))  # fmt: skip


async def _stream(client: Any, url: str, model: str, prompt: list[int], max_tokens: int) -> tuple[str, int]:
    """One streamed completion: (text, completion tokens from the usage chunk)."""
    body = dict(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, stream=True,
                stream_options={"include_usage": True})  # fmt: skip
    text, tokens = [], 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:
                raise RuntimeError(f"in-band error: {chunk['error']}")
            if chunk.get("choices"):
                text.append(chunk["choices"][0].get("text") or "")
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return "".join(text), tokens


def _gauges(metrics_text: str, names: Sequence[str]) -> dict[str, float]:
    out = {}
    for line in metrics_text.splitlines():
        for name in names:
            if line.startswith(f"jaxinfer:{name} "):
                out[name] = float(line.split()[-1])
    return out


def bench_http(args: argparse.Namespace) -> dict[str, Any]:
    """`--http-streams` concurrent streams through serve.py (engine process, step timeline on) against
    LLM.generate of the same greedy requests in this process, one after the other on an otherwise idle machine."""
    import asyncio
    import tempfile
    from pathlib import Path

    import httpx

    from benchmarks.bench_serving import REPO_ROOT, LaunchedServer, free_port
    from jaxinfer.llm import LLM
    from jaxinfer.types import SamplingParams

    if args.shape:
        raise SystemExit("--sections http needs --model (the server loads the model and its tokenizer)")
    n, m = args.http_streams, args.http_max_tokens
    settings = _http_settings(args)
    rng = np.random.default_rng(1)
    sp = SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)
    with LLM(args.model, dtype=args.dtype, warmup=True, **settings) as llm:  # every step shape, as the server
        vocab = min(llm.engine.cfg.vocab_size, llm.tokenizer.vocab_size)
        prompts = [rng.integers(0, vocab, args.prompt_len).tolist() for _ in range(n)]
        llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], sp, use_tqdm=False)  # compile, warm
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        offline_s = time.perf_counter() - t0
    offline_text = [o.outputs[0].text for o in outs]

    port = free_port()
    cmd = [sys.executable, str(REPO_ROOT / "serve.py"), "--model", args.model, "--dtype", args.dtype, "--host",
           "127.0.0.1", "--port", str(port), "--step-timeline",
           *[f"--{k.replace('_', '-')}={v}" for k, v in settings.items()]]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        srv = LaunchedServer("jaxinfer", cmd, port, Path(tmp) / "server.log")
        try:
            srv.wait_ready(900)
            model = httpx.get(f"{srv.url}/v1/models").json()["data"][0]["id"]

            async def run() -> tuple[float, list[tuple[str, int]]]:
                limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
                async with httpx.AsyncClient(timeout=httpx.Timeout(1800, connect=60), limits=limits) as client:
                    await asyncio.gather(*[_stream(client, srv.url, model, p, m) for p in prompts[:2]])  # warm
                    t0 = time.perf_counter()
                    res = await asyncio.gather(*[_stream(client, srv.url, model, p, m) for p in prompts])
                    return time.perf_counter() - t0, res

            http_s, results = asyncio.run(run())
            gauges = _gauges(httpx.get(f"{srv.url}/metrics").text, ["device_idle_share", "step_device_ms",
                                                                     "step_host_ms"])  # fmt: skip
        finally:
            srv.stop()
    http_tokens = sum(t for _, t in results)
    offline_tok_s, http_tok_s = n * m / offline_s, http_tokens / http_s
    return dict(
        streams=n, prompt_len=args.prompt_len, max_tokens=m, offline_s=offline_s, offline_tok_s=offline_tok_s,
        http_s=http_s, http_tok_s=http_tok_s, http_over_offline=http_tok_s / offline_tok_s,
        same_text=sum(a == b for a, b in zip(offline_text, [t for t, _ in results], strict=True)),
        server_idle_share=gauges.get("device_idle_share"), server_device_ms=gauges.get("step_device_ms"),
        server_host_ms=gauges.get("step_host_ms"), **settings,
    )  # fmt: skip


def http_table(rows: list[dict[str, Any]]) -> str:
    headers = ["streams", "prompt", "out", "offline tok/s", "http tok/s", "http/offline", "same text",
               "server idle%", "device_ms", "host_ms"]  # fmt: skip
    body = [
        [str(r["streams"]), str(r["prompt_len"]), str(r["max_tokens"]), f"{r['offline_tok_s']:.1f}",
         f"{r['http_tok_s']:.1f}", f"{r['http_over_offline']:.3f}", f"{r['same_text']}/{r['streams']}",
         "-" if r["server_idle_share"] is None else f"{r['server_idle_share']:.1%}",
         "-" if r["server_device_ms"] is None else f"{r['server_device_ms']:.2f}",
         "-" if r["server_host_ms"] is None else f"{r['server_host_ms']:.2f}"]
        for r in rows
    ]  # fmt: skip
    return format_table(headers, body)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_host", description=__doc__.split("\n")[0])
    p.add_argument("--model", help="model name or path (default: the server's default model)")
    p.add_argument("--shape", help="random weights at this shape (benchmarks.common.SHAPES) instead of --model")
    p.add_argument("--dtype", help="weights/KV dtype (default float32 for --model, bfloat16 for --shape)")
    p.add_argument("--batch", help=f"decode batch sizes (default {FULL_DEFAULTS['batch']})")
    p.add_argument("--prompt-len", type=int, help="prompt tokens per request")
    p.add_argument("--steps", type=int, help="timed decode steps (after --warmup-steps)")
    p.add_argument("--warmup-steps", type=int, help="decode steps left out of the summary")
    p.add_argument("--bare-iters", type=int, help="replays of the bare step (median reported)")
    p.add_argument("--prefill-tokens", type=int, help="prompt tokens a step takes beside one per decoding row")
    p.add_argument("--overlap", default="on,off", help="overlap scheduling settings to run, a comma list: on, off")
    p.add_argument("--sections", default="offline,http", help="sections to run, a comma list: offline, http")
    p.add_argument("--http-streams", type=int, default=200, help="concurrent streams in the http section")
    p.add_argument("--http-max-tokens", type=int, default=64, help="output tokens per stream in the http section")
    p.add_argument("--attn-impl", help="kernels_pallas impl (default: the dispatcher's choice)")
    p.add_argument("--quick", action="store_true", help="tiny sizes: a seconds-long run (the smoke test)")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    fill_defaults(args, QUICK_DEFAULTS, FULL_DEFAULTS)
    if args.quick and args.shape is None and args.model is None:
        args.shape = "tiny"
    if args.model is None and args.shape is None:
        from jaxinfer.llm import DEFAULT_MODEL

        args.model = DEFAULT_MODEL
    if args.dtype is None:
        args.dtype = "bfloat16" if args.shape else "float32"
    args.batch = int_list(args.batch)
    overlap = [x for x in args.overlap.split(",") if x]
    if not overlap or not set(overlap) <= {"on", "off"}:
        p.error(f"--overlap: expected a comma list of on and off, got {args.overlap!r}")
    args.overlap = [x == "on" for x in overlap]
    args.sections = [s for s in args.sections.split(",") if s]
    if not set(args.sections) <= {"offline", "http"}:
        p.error(f"--sections: unknown section in {args.sections}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    meta = metadata("benchmarks.bench_host", args, argv)
    print(f"device: {meta['device_kind']} ({meta['platform']}), jax {meta['jax_version']}, {meta['date']}, load "
          f"average {meta['load_avg_start']}; model {args.shape or args.model} ({args.dtype})", flush=True)  # fmt: skip
    offline: list[dict[str, Any]] = []
    http: list[dict[str, Any]] = []
    if "offline" in args.sections:
        for b in args.batch:
            for overlap in args.overlap:
                r = bench_offline(args, b, overlap)
                offline.append(r)
                print(f"B={b} overlap={'on' if overlap else 'off'}: {r['step_ms']:.2f} ms/step, bare "
                      f"{r['bare_ms']:.2f} ms, idle {r['idle_share']:.1%}", flush=True)  # fmt: skip
        print("\n== offline decode steps (LLM.generate path; idle% = device idle / (idle + busy) between steps)")
        print(offline_table(offline))
    if "http" in args.sections:
        http.append(bench_http(args))
        print("\n== HTTP streams vs offline, same requests")
        print(http_table(http))
    meta["load_avg_end"] = load_avg()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, offline=offline, http=http), f, indent=1)
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
