"""Paired A/B of compiled step variants in one process: the calls alternate, so a shared machine's drift falls on
every variant alike.

    python -m benchmarks.ab_step --batch 1,32 --variants default,no_attention,unroll
    python -m benchmarks.ab_step --batch 32 --variants default,impl=cpu_jnp --out ab_step.json

On these 2-core machines separate processes (`ab_cpu_runtime`) vary by +-15% from run to run, which hid a 10%
difference between the layer loops. Here each variant is compiled once from the same recorded engine step (the
default model, a decode step at `--context` tokens per row, or a seeded uniform draw per row from a range `LO-HI`,
as a real batch has) and the timed calls go round-robin over the variants,
`--rounds` times; the table has each one's median and minimum and its ratio to the first variant (> 1: faster).

Variants (comma list; the first is the baseline):
- `default`: the engine's step as built (`--layer-loop auto`);
- `scan`, `unroll`: the other layer loop, in an engine of its own (its own weights and KV pool);
- `separate_gate_up`: the scan with the MLP's gate and up kernels apart (`scanned.FUSE_GATE_UP` off, patched in
  while its engine is built), in an engine of its own;
- `kv=DTYPE`: a KV pool of this dtype (`float16`, `float32`), in an engine of its own;
- `no_attention`, `no_kv_write`, `argmax_sampler`: ablations, patched in at trace time: attention returns its
  queries, the K/V write leaves the pools as they are, the sampler is a plain argmax. What a part of the step
  costs is the baseline minus the ablation (an ablated step computes different tokens: timing only);
- `attention_threads=N`: the numba attention kernel's parallel loop on N threads (its default: NUMBA_NUM_THREADS,
  else the cores);
- `impl=NAME`: the attention implementation the dispatcher starts from (`kernels_pallas.IMPLS`): `impl=cpu_jnp` is
  the jnp path instead of the numba kernel;
- `cpu.NAME=VALUE`: a module constant of `kernels_pallas.cpu` (the jnp CPU attention's tuning) set while tracing,
  with `impl=cpu_jnp` (the default runs the numba kernel);
- `layers.NAME=VALUE`: a module constant of `jaxinfer.model.layers` set while tracing, e.g.
  `layers.WEIGHT_LEFT_MAX_ROWS=1`: every projection of two or more rows as x @ W^T (`project`'s forms);
- `+` joins several in one variant: `no_attention+no_kv_write`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import bench_latency
from benchmarks.common import SHAPES, format_table, metadata
from jaxinfer.engine.config import LAYER_LOOPS

LOOPS = tuple(loop for loop in LAYER_LOOPS if loop != "auto")  # the variants that name a layer loop


def _argmax_sample(logits: jax.Array, st: Any, **_: Any) -> Any:
    from jaxinfer.sampling import SampleOutput

    n = logits.shape[0]
    empty = jnp.zeros((n, 0), jnp.float32)
    return SampleOutput(jnp.argmax(logits, -1).astype(jnp.int32), jnp.zeros(n), empty.astype(jnp.int32), empty)


@contextlib.contextmanager
def patched(parts: Sequence[str]) -> Iterator[None]:
    """The variant's trace-time changes, undone on exit."""
    import kernels_pallas
    from jaxinfer.engine import runner
    from jaxinfer.model import layers, scanned
    from kernels_pallas import cpu, numba_ffi

    constants = {"cpu": cpu, "layers": layers}  # modules whose constants a `MODULE.NAME=VALUE` part sets

    changes: list[tuple[Any, str, Any]] = []
    for part in parts:
        if part == "no_attention":
            changes.append((kernels_pallas, "paged_decode_attention", lambda q, *_, **__: q))
        elif part == "no_kv_write":
            changes.append((kernels_pallas, "write_kv", lambda kp, vp, *_: (kp, vp)))
        elif part == "argmax_sampler":
            changes.append((runner, "sample", _argmax_sample))
        elif part == "separate_gate_up":  # read when an engine is built (run_batch), not at trace time
            changes.append((scanned, "FUSE_GATE_UP", False))
        elif part.startswith("attention_threads="):  # the numba attention kernel's threads (read at trace time)
            threads = int(part.partition("=")[2])
            changes.append((numba_ffi, "num_threads", lambda n=threads: n))
        elif part.startswith("impl="):
            if part[5:] not in kernels_pallas.IMPLS:
                raise ValueError(f"--variants: {part!r}: expected one of {kernels_pallas.IMPLS}")
        elif part.partition(".")[0] in constants and "=" in part:
            module, _, setting = part.partition(".")
            name, _, value = setting.partition("=")
            old = getattr(constants[module], name)  # AttributeError names an unknown constant
            changes.append((constants[module], name, type(old)(value)))
        elif part not in ("default", *LOOPS) and not part.startswith("kv="):
            raise ValueError(f"--variants: unknown part {part!r}")
    saved = [(mod, name, getattr(mod, name)) for mod, name, _ in changes]
    try:
        for mod, name, value in changes:
            setattr(mod, name, value)
        yield
    finally:
        for mod, name, value in reversed(saved):
            setattr(mod, name, value)


def context_lengths(context: str, batch: int) -> list[int]:
    """Prompt tokens of each row: `N` for all, or `LO-HI` drawn uniformly per row (seeded: every engine of a run,
    and every run, gets the same rows)."""
    lo, dash, hi = context.partition("-")
    if not dash:
        return [int(lo)] * batch
    if not (lo.isdigit() and hi.isdigit() and 1 <= int(lo) <= int(hi)):
        raise ValueError(f"--context: expected N or LO-HI with 1 <= LO <= HI, got {context!r}")
    return np.random.default_rng(1).integers(int(lo), int(hi) + 1, batch).tolist()


def recorded_step(loop: str, batch: int, context: str | int, shape: str | None,
                  kv_dtype: str | None = None, temperature: float = 0.0) -> tuple[Any, dict]:  # fmt: skip
    """An engine with this layer loop (the default model, or random weights at `shape`) and KV pool dtype (None: the
    weights'), `batch` rows decoding at ~`context` tokens (see `context_lengths`) and sampling at `temperature`
    (0: greedy), and its last decode step's recorded `paged_step` arguments."""
    from jaxinfer.types import SamplingParams

    lengths = context_lengths(str(context), batch)
    longest = str(max(lengths))
    argv = ["--batch", str(batch), "--context", longest, "--layer-loop", loop, "--prefill-len", longest]
    argv += ["--kv-cache-dtype", kv_dtype] if kv_dtype else []
    args = bench_latency.parse_args(argv + (["--shape", shape, "--dtype", "float32"] if shape else []))
    engine = bench_latency.build_engine(args)
    rng = np.random.default_rng(0)
    sp = SamplingParams(max_tokens=bench_latency.decode_tokens(args, batch), temperature=temperature, ignore_eos=True)
    for n in lengths:
        engine.add_request(rng.integers(0, engine.cfg.vocab_size, n).tolist(), sp)
    with bench_latency.capture_steps() as calls:
        for _ in range(1000):
            if len(calls) >= 3 and calls[-1][1].get("decode_only", False):
                break
            engine.step()
        else:
            raise RuntimeError("no decode step was recorded in 1000 steps")
    positional, kw = calls[-1]
    if positional:
        raise RuntimeError("paged_step was called with positional arguments; expected keywords")
    return engine, kw


def compiled_variant(engine: Any, kw: dict, parts: Sequence[str]) -> tuple[Callable[[], Any], Any]:
    """The recorded step compiled under the variant's changes: (a closure that runs it once, the KV pools in place
    as the engine runs it, and blocks; the compiled program, to inspect)."""
    from jaxinfer.engine.runner import STEP_STATIC_ARGS, paged_step

    def step(**kwargs: Any) -> Any:
        return paged_step.__wrapped__(**kwargs)

    # NOTE: a fresh function per variant. jax caches traces by the Python function, across jit wrappers: a new
    # `jax.jit(paged_step.__wrapped__)` hands back the engine's own trace, and the patches never take effect.
    fn = jax.jit(step, static_argnames=STEP_STATIC_ARGS, donate_argnames=("kv",))
    for part in parts:
        if part.startswith("impl="):
            kw = kw | {"impl": part[5:]}
    with patched(parts):
        compiled = fn.lower(**(kw | {"kv": engine.runner.kv})).compile()
    dynamic = {n: v for n, v in kw.items() if n not in STEP_STATIC_ARGS}  # a compiled step takes only these

    def run() -> Any:
        out, _, engine.runner.kv, _ = compiled(**(dynamic | {"kv": engine.runner.kv}))  # the pools were donated
        return jax.block_until_ready(out)

    return run, compiled


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ab_step", description=__doc__.split("\n")[0])
    p.add_argument("--variants", default="default,unroll,no_attention,argmax_sampler", help="comma list, see above")
    p.add_argument("--batch", default="1,32", help="decode batch sizes (comma list)")
    p.add_argument("--context", default="256", help="prompt tokens per row before the timed steps: N, or LO-HI")
    p.add_argument(
        "--shape", choices=list(SHAPES), help="random f32 weights at this shape (default: the default model)"
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="the rows' sampling temperature (0: greedy; > 0: every step draws, as the defaults do)",
    )
    p.add_argument("--rounds", type=int, default=30, help="timed calls of each variant, round-robin")
    p.add_argument("--out", help="write the results as JSON here")
    return p.parse_args(argv)


def run_batch(batch: int, variants: list[str], args: argparse.Namespace) -> list[dict[str, Any]]:
    from jaxinfer.engine.runner import AUTO_LAYER_LOOP

    default_loop = AUTO_LAYER_LOOP[jax.default_backend()]
    engines: dict[tuple[str, ...], tuple[Any, dict]] = {}
    runs = []
    for variant in variants:
        parts = variant.split("+")
        loop = next((p for p in parts if p in LOOPS), default_loop)
        # the parts that change the engine's build
        built_as = tuple(p for p in parts if p == "separate_gate_up" or p.startswith("kv="))
        if (loop, *built_as) not in engines:
            kv_dtype = next((p[3:] for p in built_as if p.startswith("kv=")), None)
            with patched(built_as):
                engines[loop, *built_as] = recorded_step(
                    loop, batch, args.context, args.shape, kv_dtype, args.temperature
                )
        runs.append(compiled_variant(*engines[loop, *built_as], parts)[0])
    for run in runs:  # warm: first calls touch fresh buffers
        run()
        run()
    samples: list[list[float]] = [[] for _ in runs]
    for _ in range(args.rounds):
        for i, run in enumerate(runs):
            t0 = time.perf_counter()
            run()
            samples[i].append(time.perf_counter() - t0)
    base = statistics.median(samples[0])
    return [
        dict(batch=batch, variant=v, median_ms=statistics.median(s) * 1e3, min_ms=min(s) * 1e3,
             vs_first=base / statistics.median(s))
        for v, s in zip(variants, samples, strict=True)
    ]  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    context_lengths(args.context, 1)  # a malformed --context fails before any engine is built, as do unknown parts
    for v in variants:
        with patched(v.split("+")):
            pass
    rows = []
    for batch in (int(b) for b in args.batch.split(",")):
        rows += run_batch(batch, variants, args)
        print(f"decode B={batch} done", flush=True)
    header = ["B", "variant", "median_ms", "min_ms", "vs_first"]
    table = [[str(r["batch"]), r["variant"], f"{r['median_ms']:.2f}", f"{r['min_ms']:.2f}", f"{r['vs_first']:.2f}x"]
             for r in rows]  # fmt: skip
    print(format_table(header, table))
    if args.out:
        meta = metadata("ab_step", args, argv or [])
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
