"""Single-batch latency: prefill time per prompt length and decode time per step per batch size, through the engine
and through the bare compiled step, with the host's share and the roofline fraction (MFU / MBU).

Run from the repository root:

    python -m benchmarks.bench_latency --out latency.json                       # SmolLM2 preset, default grid
    python -m benchmarks.bench_latency --prefill-len 128,512 --batch 1,8,32 --context 256   # a CPU-sized run
    python -m benchmarks.bench_latency --shape llama3-8b --batch 1,16,64 --context 600      # random weights, GPU
    python -m benchmarks.bench_latency --quick                                  # seconds (the smoke test)

Per case, two timings of the same step shape:
- `engine`: `Engine.step()` wall time with synthetic requests (random prompt ids, greedy): scheduling, packing the
  step inputs on the host, the compiled step, the device-to-host copy of the sampled tokens, the bookkeeping;
- `bare`: `jaxinfer.engine.runner.paged_step` called directly with the recorded arguments of the last timed engine
  step (the same bucket, inputs already on the device, the same compiled program), then `block_until_ready`:
  the compiled program alone.
`host%` = (engine - bare) / engine: the share of a step the host spends outside the compiled program. Prefill is
one sequence of exactly `len` prompt tokens in one step (max_num_batched_tokens is raised to fit); decode is `B`
sequences of about `--context` tokens each, one new token per row. Medians of `--iters` timed steps after
`--warmup` untimed ones; the first call's time (compilation included) is kept as `first_s`.
Roofline columns come from `benchmarks/roofline.py`: see its docstring.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from benchmarks import roofline
from benchmarks.common import (
    SHAPES,
    fill_defaults,
    format_table,
    int_list,
    load_avg,
    metadata,
    pyplot,
    random_params,
    shape_config,
    time_calls,
)
from jaxinfer.engine.config import LAYER_LOOPS

FULL_DEFAULTS: dict[str, Any] = dict(prefill_len="128,512,2048", batch="1,8,32", context=512, warmup=2, iters=10)
QUICK_DEFAULTS: dict[str, Any] = dict(prefill_len="16,32", batch="1,3", context=24, warmup=1, iters=3)


def build_engine(args: argparse.Namespace) -> Any:
    from jaxinfer.engine.config import CacheConfig
    from jaxinfer.engine.engine import Engine

    if args.shape:
        cfg = shape_config(args.shape, args.dtype or "bfloat16")
        params = random_params(cfg, seed=args.seed)
    else:
        from jaxinfer.weights import load_weights

        cfg, params, _ = load_weights(args.model, dtype=args.dtype or "float32")
    page = args.block_size
    # Room for the decode rows to grow through warm-up and timing, and for the longest prefill.
    decode_len = args.context + decode_tokens(args, max(args.batch))
    max_len = -(-max(max(args.prefill_len) + 1, decode_len) // page) * page  # + 1: the sampled token
    pages = max(max(args.batch) * -(-decode_len // page), -(-max(args.prefill_len) // page))
    cache = CacheConfig(
        block_size=page, num_pages=pages + 4, max_model_len=max_len, max_num_seqs=max(args.batch),
        max_num_batched_tokens=max(*args.prefill_len, *args.batch),
        enable_prefix_caching=False,  # every timed prefill must compute its whole prompt
        layer_loop=args.layer_loop, kv_cache_dtype=args.kv_cache_dtype,
    )  # fmt: skip
    # The plain loop: each timed step() runs and collects its own step (bench_host measures overlap scheduling).
    return recordable(Engine(cfg, params, cache, (), args.attn_impl, args.seed, overlap=False))


def recordable(engine: Any) -> Any:
    """`engine` with its executable cache off, so that `capture_steps` sees its steps: a step loaded or compiled
    through that cache never calls `paged_step`. The cache is on wherever jax's compilation cache is (the test
    suite, a JAX_COMPILATION_CACHE_DIR in the environment)."""
    engine.runner.exec_cache = None
    return engine


def decode_tokens(args: argparse.Namespace, batch: int) -> int:
    """max_tokens of a decode row: enough that no row finishes before the last bare step. Rows that finish their
    prompt early decode while the others are still prefilling (chunked, max_num_batched_tokens per step), up to
    one step per prefill chunk, before the timed steps start."""
    budget = max(*args.prefill_len, *args.batch)
    return -(-batch * args.context // budget) + batch + 2 * (1 + args.warmup + args.iters) + 8


def compile_count() -> int:
    from jaxinfer.engine.runner import compile_count as count

    return count()


@contextlib.contextmanager
def capture_steps() -> Iterator[list[tuple[tuple, dict]]]:
    """Records the arguments of every `paged_step` call the runner makes (it looks the name up in its module at
    call time, so replacing the module attribute intercepts it), to replay the engine's exact step bare."""
    from jaxinfer.engine import runner as runner_module

    original = runner_module.paged_step
    calls: list[tuple[tuple, dict]] = []

    def recording(*a: Any, **k: Any) -> Any:
        calls.append((a, k))
        return original(*a, **k)

    runner_module.paged_step = recording
    try:
        yield calls
    finally:
        runner_module.paged_step = original


def bare_step(engine: Any, call: tuple[tuple, dict]) -> Callable[[], Any]:
    """A closure calling `paged_step` directly with the arguments of a recorded engine step: the same inputs, already
    on the device, in the same form (so jit finds the program the engine compiled), the current KV pools in place
    of the donated ones. It rewrites the K/V slots that step wrote with the same values."""
    from jaxinfer.engine.runner import paged_step

    runner = engine.runner
    args, kwargs = list(call[0]), dict(call[1])
    kv_index = list(inspect.signature(paged_step).parameters).index("kv")

    def run() -> Any:
        if "kv" in kwargs:
            kwargs["kv"] = runner.kv
        else:
            args[kv_index] = runner.kv
        out, prompt_lp, runner.kv, runner.feed = paged_step(*args, **kwargs)  # the KV pools were donated
        return jax.block_until_ready((out, prompt_lp))

    return run


def bench_prefill(engine: Any, length: int, args: argparse.Namespace, rng: np.random.Generator) -> dict[str, Any]:
    from jaxinfer.types import SamplingParams

    vocab = engine.cfg.vocab_size
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def engine_prefill() -> None:
        # A fresh random prompt each time, max_tokens=1: one step prefills it, samples, and finishes it.
        engine.add_request(rng.integers(0, vocab, length).tolist(), sp)
        engine.step()
        if engine.has_unfinished():
            raise RuntimeError(f"prefill of {length} tokens took more than one step")

    with capture_steps() as calls:
        first, eng_s, eng_samples = time_calls(engine_prefill, args.warmup, args.iters)
    c0 = compile_count()
    bare_first, bare_s, bare_samples = time_calls(bare_step(engine, calls[-1]), args.warmup, args.iters)
    bare_compiles = compile_count() - c0
    trace = record_trace(engine, calls[-1], args, f"prefill_t{length}")
    _, t, _ = engine.runner.bucket_for(1, length)
    return dict(
        tokens=length, bucket_tokens=t, engine_s=eng_s, engine_min_s=min(eng_samples), bare_s=bare_s,
        bare_min_s=min(bare_samples), first_s=first, bare_first_s=bare_first, bare_compiles=bare_compiles,
        host_frac=(eng_s - bare_s) / eng_s, host_frac_min=1 - min(bare_samples) / min(eng_samples), trace=trace,
    )  # fmt: skip


def record_trace(engine: Any, call: Any, args: argparse.Namespace, name: str) -> dict | None:
    """With --trace: records the bare step's profile under DIR/name and prints where its time goes."""
    if not args.trace:
        return None
    from benchmarks import trace_table

    path = trace_table.record(bare_step(engine, call), args.iters, str(Path(args.trace) / name))
    text, trace = trace_table.table(path, args.iters) if path else ("(the profiler wrote no trace)", {})
    print(f"{name}, where the bare step's time goes:\n{text}", flush=True)
    return trace


def bench_decode(engine: Any, batch: int, args: argparse.Namespace, rng: np.random.Generator) -> dict[str, Any]:
    from jaxinfer.types import SamplingParams

    vocab = engine.cfg.vocab_size
    sp = SamplingParams(max_tokens=decode_tokens(args, batch), temperature=0.0, ignore_eos=True)
    rids = [engine.add_request(rng.integers(0, vocab, args.context).tolist(), sp) for _ in range(batch)]
    reqs = [engine.seqs[r] for r in rids]
    t0 = time.perf_counter()
    while any(not r.output_token_ids for r in reqs):  # prefill every row (and sample its first token)
        engine.step()
    prefill_s = time.perf_counter() - t0

    def engine_decode() -> None:
        if len(engine.step()) != batch:
            raise RuntimeError(f"decode step did not advance all {batch} rows")

    ctx0 = sum(r.num_computed for r in reqs) / batch
    with capture_steps() as calls:
        first, eng_s, eng_samples = time_calls(engine_decode, args.warmup, args.iters)
    mean_ctx = (ctx0 + sum(r.num_computed for r in reqs) / batch) / 2
    c0 = compile_count()
    bare_first, bare_s, bare_samples = time_calls(bare_step(engine, calls[-1]), args.warmup, args.iters)
    bare_compiles = compile_count() - c0
    trace = record_trace(engine, calls[-1], args, f"decode_b{batch}")
    for rid in rids:
        engine.abort(rid)
    _, _, s = engine.runner.bucket_for(batch, batch)
    return dict(
        batch=batch, bucket_seqs=s, context=args.context, mean_context=mean_ctx, engine_s=eng_s,
        engine_min_s=min(eng_samples), bare_s=bare_s, bare_min_s=min(bare_samples), first_s=first,
        bare_first_s=bare_first, host_frac=(eng_s - bare_s) / eng_s,
        host_frac_min=1 - min(bare_samples) / min(eng_samples), setup_prefill_s=prefill_s, bare_compiles=bare_compiles,
        trace=trace,
    )  # fmt: skip


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_latency", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="model name or path (ignored with --shape)")
    p.add_argument("--shape", choices=sorted(SHAPES), help="random weights at this shape instead of --model")
    p.add_argument("--dtype", help="weights/KV dtype (default float32 for --model, bfloat16 for --shape)")
    p.add_argument("--kv-cache-dtype", help="the KV pool's dtype (default: the weights')")
    for flag, typ, text in [
        ("--prefill-len", str, "prompt lengths, one sequence per step (comma list)"),
        ("--batch", str, "decode batch sizes (comma list)"),
        ("--context", int, "decode: prompt tokens per row before the timed steps"),
        ("--warmup", int, "untimed steps after the first"),
        ("--iters", int, "timed steps; the median is reported"),
    ]:
        name = flag[2:].replace("-", "_")
        p.add_argument(flag, type=typ, help=f"{text} (default {FULL_DEFAULTS[name]}; --quick {QUICK_DEFAULTS[name]})")
    p.add_argument("--sections", default="prefill,decode", help="sections to run, a comma list: prefill, decode")
    p.add_argument("--block-size", type=int, default=16, help="KV page size")
    p.add_argument("--attn-impl", help="kernels_pallas impl (default: the dispatcher's choice)")
    p.add_argument("--layer-loop", default="auto", choices=LAYER_LOOPS, help="how steps run the layers")
    roofline.add_peak_flags(p)
    p.add_argument("--trace", help="record a profiler trace of each bare step here and table its kernels")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny grid and few iterations: a seconds-long run")
    p.add_argument("--out", help="write the results as JSON here (and the plot beside it, .png)")
    p.add_argument("--plot", help="PNG path for the plot (default: --out with .png)")
    args = p.parse_args(argv)
    fill_defaults(args, QUICK_DEFAULTS, FULL_DEFAULTS)
    args.prefill_len, args.batch = int_list(args.prefill_len), int_list(args.batch)
    args.sections = [s for s in args.sections.split(",") if s]
    if not set(args.sections) <= {"prefill", "decode"}:
        p.error(f"--sections: unknown section in {args.sections}")
    return args


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def _timing_cells(r: dict[str, Any]) -> list[str]:
    return [f"{r['engine_s'] * 1e3:.1f}", f"{r['engine_min_s'] * 1e3:.1f}", f"{r['bare_s'] * 1e3:.1f}",
            f"{r['bare_min_s'] * 1e3:.1f}", _pct(r["host_frac"]), _pct(r["host_frac_min"])]  # fmt: skip


_TIMING_HEADERS = ["engine_ms", "eng_min", "bare_ms", "bare_min", "host%", "host%_min"]


def prefill_table(rows: list[dict[str, Any]]) -> str:
    headers = ["len", "T", *_TIMING_HEADERS, "tok/s", "floor_ms", "MFU_engine", "MFU_bare", "first_s"]
    body = [
        [str(r["tokens"]), str(r["bucket_tokens"]), *_timing_cells(r), f"{r['tokens_per_s']:.0f}",
         "-" if r["floor_s"] is None else f"{r['floor_s'] * 1e3:.1f}", _pct(r["mfu_engine"]), _pct(r["mfu_bare"]),
         f"{r['first_s']:.1f}"]
        for r in rows
    ]  # fmt: skip
    return format_table(headers, body)


def decode_table(rows: list[dict[str, Any]]) -> str:
    headers = ["B", "S", "ctx", *_TIMING_HEADERS, "tok/s", "floor_ms", "MBU_engine", "MBU_bare", "MFU_engine",
               "first_s"]  # fmt: skip
    body = [
        [str(r["batch"]), str(r["bucket_seqs"]), f"{r['mean_context']:.0f}", *_timing_cells(r),
         f"{r['tokens_per_s']:.1f}", f"{r['floor_s'] * 1e3:.2f}", _pct(r["mbu_engine"]), _pct(r["mbu_bare"]),
         _pct(r["mfu_engine"]), f"{r['first_s']:.1f}"]
        for r in rows
    ]  # fmt: skip
    return format_table(headers, body)


def write_plot(prefill: list[dict[str, Any]], decode: list[dict[str, Any]], path: str, title: str) -> str:
    """Engine and bare step time against the roofline floor: prefill by prompt length, decode by batch."""
    plt = pyplot()
    if plt is None:
        return "matplotlib is not installed: no plot (pip install matplotlib)"
    both = ((prefill, "tokens", "prefill: prompt tokens"), (decode, "batch", "decode: batch size"))
    panels = [(rows, key, label) for rows, key, label in both if rows]
    if not panels:
        return "nothing to plot"
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.8), squeeze=False)
    for ax, (rows, key, label) in zip(axes[0], panels, strict=True):
        xs = [r[key] for r in rows]
        for field, name in (("engine_s", "engine"), ("bare_s", "bare step"), ("floor_s", "roofline floor")):
            ys = [r[field] * 1e3 if r.get(field) else float("nan") for r in rows]
            ax.plot(xs, ys, marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel("ms per step")
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"wrote {path}"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    meta = metadata("benchmarks.bench_latency", args, argv)
    t0 = time.perf_counter()
    engine = build_engine(args)
    cfg = engine.cfg
    bw, bw_src, flops, flops_src = roofline.resolve_peaks(args, cfg.dtype)
    meta.update(peak_bytes_per_s=bw, peak_bw_source=bw_src, peak_flops=flops, peak_flops_source=flops_src)
    print(
        f"device: {meta['device_kind']} ({meta['platform']}), jax {meta['jax_version']}, {meta['date']}, "
        f"load average {meta['load_avg_start']}\n{args.shape or args.model} ({cfg.dtype}): "
        f"{roofline.num_params(cfg) / 1e6:.1f}M params, loaded in {time.perf_counter() - t0:.1f}s\n"
        f"peak bandwidth {bw / 1e9:.1f} GB/s ({bw_src}); peak {(flops or 0) / 1e12:.3f} TFLOP/s ({flops_src})",
        flush=True,
    )
    rng = np.random.default_rng(args.seed)
    prefill_rows: list[dict[str, Any]] = []
    decode_rows: list[dict[str, Any]] = []

    if "prefill" in args.sections:
        for n in args.prefill_len:
            r = bench_prefill(engine, n, args, rng)
            fl = roofline.step_flops(cfg, n, 1, roofline.attention_flops(cfg, n))
            floor = fl / flops if flops else None
            r.update(flops=fl, floor_s=floor, tokens_per_s=n / r["engine_s"],
                     mfu_engine=floor / r["engine_s"] if floor else None,
                     mfu_bare=floor / r["bare_s"] if floor else None)  # fmt: skip
            prefill_rows.append(r)
            print(f"prefill {n}: engine {r['engine_s'] * 1e3:.1f} ms, bare {r['bare_s'] * 1e3:.1f} ms", flush=True)
    if "decode" in args.sections:
        for b in args.batch:
            r = bench_decode(engine, b, args, rng)
            wb = roofline.decode_weight_bytes(cfg, b)
            kb = roofline.kv_bytes(cfg, int(b * r["mean_context"]))
            floor = (wb + kb) / bw
            fl = roofline.step_flops(cfg, b, b, b * roofline.attention_flops(cfg, 1, int(r["mean_context"])))
            r.update(weight_bytes=wb, kv_bytes=kb, floor_s=floor, tokens_per_s=b / r["engine_s"],
                     mbu_engine=floor / r["engine_s"], mbu_bare=floor / r["bare_s"], flops=fl,
                     mfu_engine=fl / flops / r["engine_s"] if flops else None)  # fmt: skip
            decode_rows.append(r)
            print(f"decode B={b}: engine {r['engine_s'] * 1e3:.1f} ms, bare {r['bare_s'] * 1e3:.1f} ms", flush=True)

    if prefill_rows:
        print("\n== prefill (one sequence; MFU = (2 * params * tokens + attention FLOPs) / peak / time)")
        print(prefill_table(prefill_rows))
    if decode_rows:
        print("\n== decode (one token per row; MBU = (weight + live KV bytes) / peak bandwidth / time)")
        print(decode_table(decode_rows))
    notes = [
        f"{kind} {r.get('tokens', r.get('batch'))}: the bare step compiled {r['bare_compiles']} program(s) of its own "
        "(it should replay the engine's), so its first_s is not the engine's"
        for kind, rows in (("prefill", prefill_rows), ("decode B=", decode_rows))
        for r in rows
        if r["bare_compiles"]
    ]
    for note in notes:
        print(f"note: {note}")
    meta["load_avg_end"] = load_avg()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, prefill=prefill_rows, decode=decode_rows, notes=notes), f, indent=1)
        print(f"\nwrote {args.out}")
    plot = args.plot or (str(Path(args.out).with_suffix(".png")) if args.out else None)
    if plot:
        title = f"{args.shape or args.model} ({cfg.dtype}) on {meta['device_kind']}, jax {meta['jax_version']}"
        print(write_plot(prefill_rows, decode_rows, plot, title))
    return 0


if __name__ == "__main__":
    sys.exit(main())
