"""Offline throughput through `LLM.generate`, side by side with HF transformers and llama.cpp on the same workload.

Run from the repository root:

    python -m benchmarks.bench_offline --out results.json                     # full nano-vllm workload + cells
    python -m benchmarks.bench_offline --scale 8 --cells 128/128 --out cpu.json   # CPU-sized (1/8 requests, lengths)
    python -m benchmarks.bench_offline --shape llama3-8b --references none    # random weights at a real shape (GPU)
    python -m benchmarks.bench_offline --quick                                # seconds: what the smoke test runs
    python -m benchmarks.bench_offline --defaults --out defaults.json         # plain LLM() vs hf and llama.cpp f32

Workloads:
- `nanovllm`: nano-vllm's `bench.py` workload, reproduced exactly: Python's `random.seed(0)`, 256 requests, each a
  prompt of `randint(100, 1024)` random token ids in [0, 10000], then 256 output lengths `randint(100, 1024)`;
  `ignore_eos=True`, temperature 0.6. Totals 142,827 prompt and 133,966 output tokens (checked at full size).
  `--scale S` keeps the first 256 / S requests and divides every length by S.
- cells `P/O` (`--cells 128/128,1000/1000,...`): `--cell-requests` requests of exactly P random prompt tokens and O
  output tokens, also divided by `--scale`.
- `mixed`: `--num-requests` (default 256) prompts of `randint(16, 256)` random token ids, 128 output tokens each
  (issue #14's workload). `--defaults` runs it greedily through a plain `LLM(model)` (no tuning flags: what users
  get) against transformers and llama.cpp f32, and adds peak RSS and greedy agreement on the first 16 requests.

Engines: jaxinfer in this process (`LLM.generate`; with `--shape`, an `Engine` over random weights), then each
reference from `benchmarks/references.py` in a child process (`--references hf,llamacpp,llamacpp-quant`, or none).
References decode greedily; jaxinfer samples at `--temperature` (0.6, as nano-vllm; 0 for greedy).
See benchmarks/README.md for the columns. This is a measurement tool, not a test: it asserts no speed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import references
from benchmarks.common import (
    SHAPES,
    fill_defaults,
    format_table,
    load_avg,
    metadata,
    pyplot,
    random_params,
    shape_config,
)
from jaxinfer.device import KV_CACHE_DTYPES
from jaxinfer.engine.config import LAYER_LOOPS
from jaxinfer.host_memory import reuse_large_blocks

REPO_ROOT = Path(__file__).resolve().parent.parent

# nano-vllm bench.py's workload and the totals its generator gives (Python's random, seed 0).
NANOVLLM = dict(num_seqs=256, max_input_len=1024, max_output_len=1024, min_len=100, max_token_id=10000, seed=0)
NANOVLLM_PROMPT_TOKENS = 142_827
NANOVLLM_OUTPUT_TOKENS = 133_966
NANOVLLM_TEMPERATURE = 0.6

Request = tuple[list[int], int]  # (prompt token ids, max_tokens)

FULL_DEFAULTS: dict[str, Any] = dict(
    scale=1, num_requests=None, cells="128/128,1000/1000,2048/128,128/2048", cell_requests=64,
    max_num_seqs=32, max_num_batched_tokens=None, references="hf,llamacpp,llamacpp-quant",
)  # fmt: skip
# --defaults: what a user gets from `LLM()`, on issue #14's mixed workload.
DEFAULTS_MODE: dict[str, Any] = dict(
    sections="mixed", num_requests=256, references="hf,llamacpp", temperature=0.0, check_prompts=16,
)  # fmt: skip
MIXED = dict(min_prompt=16, max_prompt=256, output=128)
# The engine settings --defaults still passes to LLM() when given explicitly: for an A/B against the defaults.
AB_FLAGS = ("layer_loop", "max_num_seqs", "max_num_batched_tokens", "kv_cache_dtype")
QUICK_DEFAULTS: dict[str, Any] = dict(
    scale=32, num_requests=4, cells="256/128", cell_requests=64, max_num_seqs=4, max_num_batched_tokens=32,
    references="none",
)  # fmt: skip


# --- workloads -----------------------------------------------------------------------------------------


def nanovllm_requests() -> list[Request]:
    """nano-vllm's generator, call for call: all prompts (length, then its ids) first, then all output lengths."""
    w = NANOVLLM
    rng = random.Random(w["seed"])  # same stream as the module-level random.seed(0) nano-vllm uses
    prompts = [
        [rng.randint(0, w["max_token_id"]) for _ in range(rng.randint(w["min_len"], w["max_input_len"]))]
        for _ in range(w["num_seqs"])
    ]
    max_tokens = [rng.randint(w["min_len"], w["max_output_len"]) for _ in range(w["num_seqs"])]
    return list(zip(prompts, max_tokens, strict=True))


def scale_requests(reqs: list[Request], scale: int, num_requests: int | None) -> list[Request]:
    """The first `num_requests` (default len / scale) requests, every length divided by `scale` (at least 1)."""
    n = num_requests if num_requests is not None else max(1, len(reqs) // scale)
    return [(p[: max(1, len(p) // scale)], max(1, m // scale)) for p, m in reqs[:n]]


def cell_requests(prompt_len: int, output_len: int, n: int, seed: int) -> list[Request]:
    rng = random.Random(f"cell-{prompt_len}-{output_len}-{seed}")
    return [([rng.randint(0, NANOVLLM["max_token_id"]) for _ in range(prompt_len)], output_len) for _ in range(n)]


def mixed_requests(n: int, seed: int) -> list[Request]:
    """Issue #14's mixed workload: prompts of 16-256 random token ids, 128 output tokens each."""
    rng = random.Random(f"mixed-{seed}")
    return [([rng.randint(0, NANOVLLM["max_token_id"]) for _ in range(rng.randint(MIXED["min_prompt"],
                                                                                  MIXED["max_prompt"]))],
             MIXED["output"]) for _ in range(n)]  # fmt: skip


def build_workloads(args: argparse.Namespace, vocab_size: int) -> dict[str, list[Request]]:
    out: dict[str, list[Request]] = {}
    if "mixed" in args.sections:
        out["mixed"] = mixed_requests(args.num_requests or DEFAULTS_MODE["num_requests"], args.seed)
    if "nanovllm" in args.sections:
        full = nanovllm_requests()
        prompt_total, output_total = sum(len(p) for p, _ in full), sum(m for _, m in full)
        # The generator must be nano-vllm's, or the figures are not comparable with theirs.
        assert (prompt_total, output_total) == (NANOVLLM_PROMPT_TOKENS, NANOVLLM_OUTPUT_TOKENS), (
            prompt_total,
            output_total,
        )
        out["nanovllm"] = scale_requests(full, args.scale, args.num_requests)
    if "cells" in args.sections:
        n = max(1, args.cell_requests // args.scale)
        for p_len, o_len in args.cells:
            p, o = max(1, p_len // args.scale), max(1, o_len // args.scale)
            out[f"{p}/{o}"] = cell_requests(p, o, n, args.seed)
    if vocab_size <= NANOVLLM["max_token_id"]:  # only the tiny test shape: fold ids into its vocabulary
        out = {k: [([t % vocab_size for t in p], m) for p, m in v] for k, v in out.items()}
    return out


# --- jaxinfer ------------------------------------------------------------------------------------------


class EngineProbe:
    """Wraps an engine's `scheduler.schedule` and `step` (instance attributes, so nothing else changes) to record,
    per run: the peak of live KV pages right after each schedule (allocation happens there; pages of sequences
    that finish in a step are freed before `step` returns, so polling after `step` would miss the peak), the
    largest batch, and the wall time of steps that carry prompt tokens vs decode-only steps (a step waits for its
    sampled tokens, so its wall time is the step's)."""

    def __init__(self, engine: Any):
        self.engine = engine
        self._schedule, self._step = engine.scheduler.schedule, engine.step
        engine.scheduler.schedule, engine.step = self.schedule, self.step
        self.reset()

    def reset(self) -> None:
        self.peak_pages = self.max_batch = 0
        self.mixed_steps = self.decode_steps = self.mixed_tokens = 0
        self.mixed_s = self.decode_s = 0.0
        self.decode_rows = self.decode_bucket_rows = 0  # live rows of decode-only steps, and their buckets' rows
        self._decode_only: bool | None = None
        self._rows = self._bucket_rows = 0  # the scheduled decode-only batch's live rows and its bucket's rows

    def schedule(self) -> Any:
        batch = self._schedule()
        if batch:
            self.peak_pages = max(self.peak_pages, self.engine.allocator.num_used)
            self.max_batch = max(self.max_batch, len(batch))
            tokens = sum(s.num_new for s in batch)
            self._decode_only = tokens == len(batch)
            if self._decode_only:
                self._rows, self._bucket_rows = len(batch), self.engine.runner.bucket_for(len(batch), tokens)[2]
            else:
                self.mixed_tokens += tokens
        return batch

    def step(self) -> Any:
        self._decode_only = None
        t0 = time.perf_counter()
        out = self._step()
        dt = time.perf_counter() - t0
        if self._decode_only is True:
            self.decode_steps += 1
            self.decode_s += dt
            self.decode_rows += self._rows
            self.decode_bucket_rows += self._bucket_rows
        elif self._decode_only is False:
            self.mixed_steps += 1
            self.mixed_s += dt
        return out


@dataclass
class JaxEngine:
    label: str
    engine: Any
    generate: Callable[[list[Request], float], list[list[int]]]  # (requests, temperature) -> output token ids
    load_s: float
    close: Callable[[], None]


def make_jaxinfer(args: argparse.Namespace, max_model_len: int) -> JaxEngine:
    from jaxinfer.types import SamplingParams

    num_kv_tokens = args.num_kv_tokens if args.num_kv_tokens is not None else args.max_num_seqs * max_model_len
    mnbt = args.max_num_batched_tokens or max(256, args.max_num_seqs)
    t0 = time.perf_counter()

    def params_for(reqs: list[Request], temperature: float) -> list[SamplingParams]:
        return [SamplingParams(max_tokens=m, temperature=temperature, ignore_eos=True, seed=i)
                for i, (_, m) in enumerate(reqs)]  # fmt: skip

    if args.shape:
        from jaxinfer.engine.config import CacheConfig
        from jaxinfer.engine.engine import Engine

        cfg = shape_config(args.shape, args.dtype or "bfloat16")
        cache = CacheConfig(
            block_size=args.block_size, num_pages=-(-num_kv_tokens // args.block_size) if num_kv_tokens else None,
            gpu_memory_utilization=args.memory_fraction, max_model_len=max_model_len, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=mnbt,
        )  # fmt: skip
        engine = Engine(cfg, random_params(cfg, seed=args.seed), cache, (), args.attn_impl, args.seed)

        def generate(reqs: list[Request], temperature: float) -> list[list[int]]:
            done = engine.generate([p for p, _ in reqs], params_for(reqs, temperature))
            return [seqs[0].output_token_ids for seqs in done]

        return JaxEngine(f"jaxinfer[{args.shape}]", engine, generate, time.perf_counter() - t0, lambda: None)

    from jaxinfer.llm import LLM

    if args.defaults:  # no tuning flags: the pool, buckets and lengths are the library's defaults
        # Only the A/B flags given explicitly reach LLM(): everything else stays the library's default.
        ab = {k: getattr(args, k) for k in AB_FLAGS if k in args.ab_overrides}
        llm = LLM(args.model, **ab)
    else:
        llm = LLM(
        args.model, dtype=args.dtype or "float32", max_model_len=max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=mnbt, block_size=args.block_size, num_kv_tokens=num_kv_tokens or None,
        gpu_memory_utilization=args.memory_fraction, seed=args.seed, attn_impl=args.attn_impl,
        **({"layer_loop": args.layer_loop} if args.layer_loop else {}),
        **({"kv_cache_dtype": args.kv_cache_dtype} if args.kv_cache_dtype else {}),
        )  # fmt: skip

    def generate_llm(reqs: list[Request], temperature: float) -> list[list[int]]:
        outs = llm.generate([{"prompt_token_ids": p} for p, _ in reqs], params_for(reqs, temperature), use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    return JaxEngine("jaxinfer", llm.engine, generate_llm, time.perf_counter() - t0, llm.close)


@dataclass
class JaxRun:
    """A loaded, warmed-up jaxinfer engine that times the workloads once per round (`time_round`)."""

    je: JaxEngine
    probe: EngineProbe
    warmup_s: float
    warmup_compiles: int
    rss_loaded: float


def start_jaxinfer(args: argparse.Namespace, workloads: dict[str, list[Request]]) -> JaxRun:
    from jaxinfer.engine.runner import compile_count

    max_model_len = args.max_model_len or max(len(p) + m for reqs in workloads.values() for p, m in reqs)
    max_model_len = -(-max_model_len // args.block_size) * args.block_size
    je = make_jaxinfer(args, max_model_len)
    engine = je.engine
    print(f"{je.label}: loaded in {je.load_s:.1f}s; KV pool {engine.allocator.num_pages} pages x "
          f"{engine.cc.block_size}, max_model_len {engine.cc.max_model_len}, max_num_seqs {engine.cc.max_num_seqs}, "
          f"max_num_batched_tokens {engine.cc.max_num_batched_tokens}", flush=True)  # fmt: skip

    # Warm-up: compile every bucket, then one short request (as nano-vllm's bench does before timing).
    c0, t0 = compile_count(), time.perf_counter()
    rss_loaded = peak_rss_mib()
    engine.runner.warmup(advanced=False)
    je.generate([([1, 2, 3, 4], 2)], args.temperature)
    warmup_s, warmup_compiles = time.perf_counter() - t0, compile_count() - c0
    print(f"{je.label}: warm-up {warmup_s:.1f}s ({warmup_compiles} compilations)", flush=True)
    return JaxRun(je, EngineProbe(engine), warmup_s, warmup_compiles, rss_loaded)


def time_round(run: JaxRun, args: argparse.Namespace, workloads: dict[str, list[Request]], rnd: int) -> list[dict]:
    """One timed pass over every workload: a row each."""
    from jaxinfer.engine.runner import compile_count

    je, engine, probe = run.je, run.je.engine, run.probe
    page_bytes = engine.runner.page_bytes
    rows = []
    for name, reqs in workloads.items():
        probe.reset()
        # Every round computes its prompts: a pool large enough to keep the last round's prompt pages (float16 K/V
        # on CPU) had the second round skip most prefills (6 prompt-carrying steps instead of 88).
        engine.reset_prefix_cache()
        steps0 = engine.num_steps
        load0 = load_avg()
        c0, t0 = compile_count(), time.perf_counter()
        outs = je.generate(reqs, args.temperature)
        elapsed = time.perf_counter() - t0
        compiles = compile_count() - c0
        bad = [i for i, (o, (_, m)) in enumerate(zip(outs, reqs, strict=True)) if len(o) != m]
        if bad:
            raise RuntimeError(f"{name}: requests {bad[:5]} did not produce exactly max_tokens tokens")
        steps = engine.num_steps - steps0
        rows.append(
            _row(name, je.label, reqs, elapsed, rnd)
            | dict(
                load_s=je.load_s, warmup_s=run.warmup_s, warmup_compiles=run.warmup_compiles, compiles=compiles,
                steps=steps, max_batch=probe.max_batch, mixed_steps=probe.mixed_steps, mixed_s=probe.mixed_s,
                mixed_tokens=probe.mixed_tokens, decode_steps=probe.decode_steps, decode_s=probe.decode_s,
                host_s=elapsed - probe.mixed_s - probe.decode_s,  # outside engine.step: output processing
                decode_step_ms=probe.decode_s / probe.decode_steps * 1e3 if probe.decode_steps else None,
                decode_rows=probe.decode_rows / probe.decode_steps if probe.decode_steps else None,
                decode_fill=probe.decode_rows / probe.decode_bucket_rows if probe.decode_bucket_rows else None,
                peak_kv_pages=probe.peak_pages, kv_pages=engine.allocator.num_pages,
                peak_kv_frac=probe.peak_pages / engine.allocator.num_pages,
                peak_kv_mib=probe.peak_pages * page_bytes / 2**20, temperature=args.temperature,
                load_avg=[load0, load_avg()], first_tokens=[o[:64] for o in outs[: args.check_prompts]],
                peak_rss_mib=peak_rss_mib(), peak_rss_after_load_mib=run.rss_loaded,
            )
        )  # fmt: skip
        print(f"{je.label} {name}: {rows[-1]['output_tok_s']:.1f} output tok/s ({elapsed:.1f}s)", flush=True)
    return rows


def finish_jaxinfer(run: JaxRun, check: list[Request]) -> dict[str, Any]:
    """Greedy tokens of the check prompts, run alone (the agreement check with the references); frees the engine."""
    je = run.je
    check_tokens = [je.generate([(p, min(m, 32))], 0.0)[0] for p, m in check]
    je.close()
    return dict(label=je.label, check_tokens=check_tokens, warmup_s=run.warmup_s, load_s=je.load_s)


def peak_rss_mib() -> float:
    """This process's peak resident set so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _row(workload: str, engine: str, reqs: list[Request], elapsed: float, rnd: int) -> dict[str, Any]:
    prompt_tokens, output_tokens = sum(len(p) for p, _ in reqs), sum(m for _, m in reqs)
    return dict(
        workload=workload, engine=engine, round=rnd, requests=len(reqs), prompt_tokens=prompt_tokens,
        output_tokens=output_tokens, elapsed_s=elapsed, output_tok_s=output_tokens / elapsed,
        total_tok_s=(prompt_tokens + output_tokens) / elapsed, requests_per_s=len(reqs) / elapsed,
    )  # fmt: skip


# --- references ----------------------------------------------------------------------------------------


def run_reference(
    engine: str, args: argparse.Namespace, workloads: dict[str, list[Request]], tmp: Path, notes: list[str], rnd: int
) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    python = sys.executable if engine == "hf" else args.llamacpp_python
    missing = references.hf_missing() if engine == "hf" else None
    if engine != "hf" and python == sys.executable:
        missing = references.llama_cpp_missing()
    if missing:
        notes.append(f"{engine}: skipped: {missing}")
        print(f"note: {notes[-1]}", flush=True)
        return [], None
    wl_file, out_file, log_file = tmp / "workload.json", tmp / f"{engine}.json", tmp / f"{engine}.log"
    if not wl_file.exists():
        wl_file.write_text(json.dumps(workloads))
    cmd = [
        python, "-m", "benchmarks.references", "--engine", engine, "--model", args.model,
        "--workload", str(wl_file), "--out", str(out_file), "--threads", str(args.threads),
        "--batch-size", str(args.hf_batch_size), "--n-seq-max", str(args.llamacpp_seqs),
        "--check-prompts", str(args.check_prompts),
    ]  # fmt: skip
    print(f"{engine}: running in a child process (log: {log_file})", flush=True)
    load0 = load_avg()
    # No progress bars in the log (transformers' GGUF conversion draws one); the log is for errors.
    env = {**os.environ, "TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    with open(log_file, "w") as log:
        try:
            proc = subprocess.run(cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, env=env, check=False,
                                  timeout=args.reference_timeout or None)  # fmt: skip
        except subprocess.TimeoutExpired:
            notes.append(f"{engine}: stopped after --reference-timeout {args.reference_timeout}s")
            print(f"note: {notes[-1]}", flush=True)
            return [], None
    if proc.returncode != 0:
        tail = log_file.read_text().strip().splitlines()[-3:]
        why = f"exit {proc.returncode}"
        if proc.returncode < 0:
            why = f"killed by {signal.Signals(-proc.returncode).name}"
        if proc.returncode == -signal.SIGILL:
            # Seen with the shared llama-cpp-python wheel on an AVX-512 EPYC: built with GGML_AVX_VNNI=ON, its
            # quantized dot products use VEX-encoded vpdpbusd, which CPUs with only avx512_vnni lack.
            why += " (illegal instruction: the wheel was built for instructions this CPU lacks, e.g. avx_vnni)"
        notes.append(f"{engine}: FAILED ({why}); log tail: {' | '.join(tail)[-300:]}")
        print(f"note: {notes[-1]}", flush=True)
        return [], None
    res = json.loads(out_file.read_text())
    notes.extend(f"{engine}: {n}" for n in res.get("notes", []))
    rows = []
    for name, reqs in workloads.items():
        w = res["workloads"][name]
        if w["output_lens"] != [m for _, m in reqs]:
            notes.append(f"{engine} {name}: output lengths differ from max_tokens")
        rows.append(
            _row(name, engine, reqs, w["elapsed_s"], rnd)
            | dict(load_s=res["load_s"], warmup_s=res["warmup_s"], load_avg=[load0, load_avg()],
                   first_tokens=w["first_tokens"], **{k: w[k] for k in ("decoded_tokens", "decode_calls") if k in w},
                   peak_rss_mib=resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)
        )  # fmt: skip
        print(f"{engine} {name}: {rows[-1]['output_tok_s']:.1f} output tok/s ({w['elapsed_s']:.1f}s)", flush=True)
    return rows, res


def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, Any]:
    """How many token lists are equal, and where the first difference of each unequal pair is."""
    diverge = []
    for x, y in zip(a, b, strict=True):
        if x != y:
            diverge.append(next((i for i, (u, v) in enumerate(zip(x, y, strict=False)) if u != v), min(len(x), len(y))))
    return dict(equal=len(a) - len(diverge), of=len(a), first_difference_at=diverge)


# --- output --------------------------------------------------------------------------------------------


def _jaxinfer_rows(rows: list[dict[str, Any]]) -> dict[tuple[str, int], dict[str, Any]]:
    return {(r["workload"], r["round"]): r for r in rows if r["engine"].startswith("jaxinfer")}


def _vs_jaxinfer(r: dict[str, Any], base: dict[tuple[str, int], dict[str, Any]]) -> float | None:
    """jaxinfer's output tok/s over this reference row's, in the same workload and round (None: a jaxinfer row)."""
    j = base.get((r["workload"], r["round"]))
    return None if j is None or j is r else j["output_tok_s"] / r["output_tok_s"]


def throughput_table(rows: list[dict[str, Any]]) -> str:
    """A row per engine, workload and round; `jaxinfer_vs` against jaxinfer's row of the same workload and round."""
    base = _jaxinfer_rows(rows)
    rounds = len({r["round"] for r in rows}) > 1
    headers = ["workload", *(["round"] if rounds else []), "engine", "reqs", "prompt_tok", "out_tok", "time_s",
               "out_tok/s", "total_tok/s", "req/s", "jaxinfer_vs"]  # fmt: skip
    body = []
    for r in rows:
        vs = _vs_jaxinfer(r, base)
        ratio = "-" if vs is None else f"{vs:.2f}x"
        body.append([r["workload"], *([str(r["round"])] if rounds else []), r["engine"], str(r["requests"]),
                     str(r["prompt_tokens"]), str(r["output_tokens"]), f"{r['elapsed_s']:.2f}",
                     f"{r['output_tok_s']:.1f}", f"{r['total_tok_s']:.1f}", f"{r['requests_per_s']:.2f}",
                     ratio])  # fmt: skip
    return format_table(headers, body)


def ratio_table(rows: list[dict[str, Any]]) -> str:
    """jaxinfer's output tok/s over each reference's, per round (the two ran back to back) and their median."""
    base = _jaxinfer_rows(rows)
    pairs: dict[tuple[str, str], list[float]] = {}
    for r in rows:
        vs = _vs_jaxinfer(r, base)
        if vs is not None:
            pairs.setdefault((r["workload"], r["engine"]), []).append(vs)
    body = [[w, e, " ".join(f"{x:.2f}x" for x in v), f"{statistics.median(v):.2f}x"] for (w, e), v in pairs.items()]
    return format_table(["workload", "vs engine", "per round", "median"], body)


def jaxinfer_table(rows: list[dict[str, Any]]) -> str:
    headers = ["workload", "steps", "max_B", "prefill_steps", "prefill_s", "decode_steps", "decode_s", "ms/decode",
               "rows/decode", "host_s", "peak_kv", "peak_kv_MiB", "compiles"]  # fmt: skip
    body = [
        [r["workload"], str(r["steps"]), str(r["max_batch"]), str(r["mixed_steps"]), f"{r['mixed_s']:.1f}",
         str(r["decode_steps"]), f"{r['decode_s']:.1f}",
         "-" if r["decode_step_ms"] is None else f"{r['decode_step_ms']:.1f}",
         "-" if r["decode_rows"] is None else f"{r['decode_rows']:.1f} ({r['decode_fill']:.0%})",
         f"{r['host_s']:.1f}",
         f"{r['peak_kv_pages']}/{r['kv_pages']} ({r['peak_kv_frac']:.0%})", f"{r['peak_kv_mib']:.0f}",
         str(r["compiles"])]
        for r in rows if r["engine"].startswith("jaxinfer")
    ]  # fmt: skip
    return format_table(headers, body)


def write_plot(rows: list[dict[str, Any]], path: Path, title: str) -> str:
    plt = pyplot()
    if plt is None:
        return "matplotlib is not installed: no plot (pip install matplotlib)"
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    engines = list(dict.fromkeys(r["engine"] for r in rows))
    width = 0.8 / len(engines)
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(workloads) * len(engines) ** 0.5), 4))
    for k, eng in enumerate(engines):
        per = {w: [r["output_tok_s"] for r in rows if r["engine"] == eng and r["workload"] == w] for w in workloads}
        vals = {w: statistics.median(v) for w, v in per.items() if v}  # the median over rounds
        xs = [i + (k - (len(engines) - 1) / 2) * width for i in range(len(workloads))]
        ax.bar(xs, [vals.get(w, 0.0) for w in workloads], width, label=eng)
    ax.set_xticks(range(len(workloads)), workloads)
    ax.set_ylabel("output tokens / s")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"wrote {path}"


# --- CLI -----------------------------------------------------------------------------------------------


def _cells(text: str) -> list[tuple[int, int]]:
    out = []
    for cell in (c for c in text.split(",") if c.strip()):
        p, _, o = cell.partition("/")
        if not (p.strip().isdigit() and o.strip().isdigit()) or int(p) < 1 or int(o) < 1:
            raise argparse.ArgumentTypeError(f"--cells: expected PROMPT/OUTPUT pairs like 128/128, got {cell!r}")
        out.append((int(p), int(o)))
    return out


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_offline", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="model name or path for jaxinfer and references")
    p.add_argument("--shape", choices=sorted(SHAPES), help="random weights at this shape instead of --model")
    p.add_argument("--dtype", help="weights/KV dtype (default float32 for --model, bfloat16 for --shape)")
    p.add_argument("--sections", default="nanovllm,cells", help="comma list of nanovllm, cells, mixed")
    for flag, typ, text in [
        ("--scale", int, "divide request counts and every length by this"),
        ("--num-requests", int, "nanovllm: requests to keep (overrides 256 / scale)"),
        ("--cells", str, "fixed-length cells PROMPT/OUTPUT, comma list (divided by --scale)"),
        ("--cell-requests", int, "requests per cell (divided by --scale)"),
        ("--max-num-seqs", int, "jaxinfer: sequences per step (with --defaults only when given, an A/B)"),
        ("--max-num-batched-tokens", int, "jaxinfer: step token budget (None: max(256, max_num_seqs); as above)"),
        ("--references", str, "comma list of hf, llamacpp, llamacpp-quant; or none"),
    ]:
        name = flag[2:].replace("-", "_")
        p.add_argument(flag, type=typ, help=f"{text} (default {FULL_DEFAULTS[name]}; --quick {QUICK_DEFAULTS[name]})")
    p.add_argument("--temperature", type=float, default=NANOVLLM_TEMPERATURE, help="jaxinfer sampling temperature")
    p.add_argument("--max-model-len", type=int, help="jaxinfer (default: the longest request, rounded to a page)")
    p.add_argument("--block-size", type=int, default=16, help="jaxinfer KV page size")
    p.add_argument(
        "--num-kv-tokens", type=int, help="jaxinfer KV pool (default max_num_seqs * max_model_len; 0: memory fraction)"
    )
    p.add_argument("--memory-fraction", type=float, default=0.5, help="jaxinfer: with --num-kv-tokens 0")
    p.add_argument("--attn-impl", help="kernels_pallas impl for jaxinfer (default: the dispatcher's choice)")
    p.add_argument("--layer-loop", choices=LAYER_LOOPS,
                   help="jaxinfer's layer loop, for an A/B (default: the library's, also with --defaults)")  # fmt: skip
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES,
                   help="jaxinfer's KV pool dtype, for an A/B (default: the library's, --defaults too)")  # fmt: skip
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="references: CPU threads")
    p.add_argument("--hf-batch-size", type=int, default=32, help="hf: requests per generate() call")
    p.add_argument("--llamacpp-seqs", type=int, default=64, help="llamacpp: concurrent sequences (n_seq_max)")
    p.add_argument("--check-prompts", type=int, default=2, help="prompts for the greedy agreement check")
    p.add_argument("--rounds", type=int, default=1,
                   help="time every engine this many times, alternating (jaxinfer, then each reference): the "
                        "ratios of back-to-back runs, and their median, resist a shared machine's drift")  # fmt: skip
    p.add_argument("--reference-timeout", type=float, default=0, help="seconds per reference process (0: none)")
    p.add_argument("--llamacpp-python", default=sys.executable,
                   help="interpreter for the llama.cpp references (e.g. a venv with a llama-cpp-python rebuilt for "
                   "this CPU: see benchmarks/README.md)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny workload, references off: a seconds-long run")
    p.add_argument("--defaults", action="store_true",
                   help="plain LLM(model) on the mixed workload, greedy, vs hf and llama.cpp f32 (issue #14); "
                   "--num-requests scales it down")  # fmt: skip
    p.add_argument("--out", help="write the results as JSON here (and the plot beside it, .png)")
    p.add_argument("--plot", help="PNG path for the bar plot (default: --out with .png)")
    args = p.parse_args(argv)

    given = {a.split("=")[0] for a in (argv or sys.argv[1:]) if a.startswith("--")}
    args.ab_overrides = [f for f in AB_FLAGS if f"--{f.replace('_', '-')}" in given]
    if args.defaults:
        for name, value in DEFAULTS_MODE.items():
            if f"--{name.replace('_', '-')}" not in given:
                setattr(args, name, value)
    fill_defaults(args, QUICK_DEFAULTS, FULL_DEFAULTS)
    args.cells = _cells(args.cells)
    args.sections = [s for s in args.sections.split(",") if s]
    if not set(args.sections) <= {"nanovllm", "cells", "mixed"}:
        p.error(f"--sections: unknown section in {args.sections}")
    refs = [r for r in args.references.split(",") if r and r != "none"]
    if set(refs) - set(references.ENGINES):
        p.error(f"--references: unknown {sorted(set(refs) - set(references.ENGINES))}; expected {references.ENGINES}")
    args.references = refs
    if args.scale < 1:
        p.error("--scale must be >= 1")
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    # What a process whose first jax call is LLM() gets (build_engine does it first): the metadata below starts jax.
    reuse_large_blocks()
    meta = metadata("benchmarks.bench_offline", args, argv)
    print(f"device: {meta['device_kind']} ({meta['platform']}), jax {meta['jax_version']}, {meta['date']}, "
          f"load average {meta['load_avg_start']}", flush=True)  # fmt: skip
    notes: list[str] = []
    vocab = shape_config(args.shape).vocab_size if args.shape else 1 << 30
    workloads = build_workloads(args, vocab)
    if "nanovllm" in args.sections:
        full = args.scale == 1 and args.num_requests in (None, NANOVLLM["num_seqs"])
        print(f"nano-vllm workload: full size {NANOVLLM_PROMPT_TOKENS:,} prompt + {NANOVLLM_OUTPUT_TOKENS:,} output "
              f"tokens (checked){'' if full else '; scaled: ' + _summary(workloads['nanovllm'])}")  # fmt: skip
    for name, reqs in workloads.items():
        print(f"  {name}: {_summary(reqs)}")
    first = next(iter(workloads.values()))
    check = first[: args.check_prompts]

    if args.references and args.shape:
        notes.append("references skipped: --shape runs random weights, which the references cannot load")
        args.references = []
    # Rounds alternate the engines (jaxinfer, then each reference), so a shared machine's slow spell falls on all
    # of them; the references reload in a child process each round, jaxinfer stays loaded.
    run, rows = start_jaxinfer(args, workloads), []
    refs: dict[str, dict[str, Any]] = {}  # each reference's first round's results (its check tokens)
    failed: set[str] = set()
    with tempfile.TemporaryDirectory(prefix="bench_offline_") as tmp:
        for rnd in range(1, args.rounds + 1):
            rows += time_round(run, args, workloads, rnd)
            for engine in (e for e in args.references if e not in failed):
                ref_rows, res = run_reference(engine, args, workloads, Path(tmp), notes, rnd)
                rows += ref_rows
                if res is None:
                    failed.add(engine)
                else:
                    refs.setdefault(engine, res)
    jax_info = finish_jaxinfer(run, check)

    checks: dict[str, Any] = {}
    if "hf" in refs:
        base = refs["hf"]["check_tokens"]
        checks[f"{jax_info['label']} vs hf"] = agreement(jax_info["check_tokens"], base)
        for eng in ("llamacpp", "llamacpp-quant"):
            if eng in refs:
                checks[f"{eng} vs hf"] = agreement(refs[eng]["check_tokens"], base)

    if args.defaults and "hf" in refs:
        # Greedy everywhere: the batched workload's own tokens must agree too (first 64 of each checked request).
        for name in workloads:
            got = {r["engine"]: r["first_tokens"] for r in rows if r["workload"] == name and r["round"] == 1}
            for eng in (jax_info["label"], "llamacpp"):
                if eng in got and "hf" in got:
                    checks[f"{eng} vs hf, {name} workload batched"] = agreement(got[eng], got["hf"])
    print("\n== offline throughput (jaxinfer_vs: jaxinfer output tok/s / this engine's; > 1: jaxinfer faster)")
    print(throughput_table(rows))
    if args.rounds > 1:
        print(f"\n== jaxinfer's ratio to each reference, round by round, and the median of {args.rounds} rounds")
        print(ratio_table(rows))
    print("\n== peak RSS (MiB; references: the largest child process so far)")
    for r in rows:
        if r.get("peak_rss_mib"):
            print(f"{r['engine']:>10} {r['workload']}: {r['peak_rss_mib']:.0f}")
    print("\n== jaxinfer steps (prefill: steps carrying prompt tokens; host: time outside engine.step)")
    print(jaxinfer_table(rows))
    if checks:
        print(f"\n== greedy agreement on the first {args.check_prompts} prompts, run alone, up to 32 tokens")
        for pair, c in checks.items():
            print(f"{pair}: {c['equal']}/{c['of']} equal" + (f", first differences at {c['first_difference_at']}"
                                                              if c["first_difference_at"] else ""))  # fmt: skip
    meta["load_avg_end"] = load_avg()
    for note in notes:
        print(f"note: {note}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, rows=rows, checks=checks, notes=notes), f, indent=1)
        print(f"\nwrote {args.out}")
    plot = args.plot or (str(Path(args.out).with_suffix(".png")) if args.out else None)
    if plot:
        print(write_plot(rows, Path(plot), f"{args.shape or args.model}, {meta['device_kind']}, {meta['date'][:10]}"))
    return 0


def _summary(reqs: list[Request]) -> str:
    p, o = [len(x) for x, _ in reqs], [m for _, m in reqs]
    return (f"{len(reqs)} requests, prompt {min(p)}..{max(p)} ({sum(p):,} tokens), "
            f"output {min(o)}..{max(o)} ({sum(o):,} tokens)")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
