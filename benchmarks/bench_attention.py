"""Paged-attention benchmark: decode time and achieved memory bandwidth, ragged-prefill throughput.

Run from the repository root:

    python -m benchmarks.bench_attention --out results.json
    python -m benchmarks.bench_attention --quick           # seconds, tiny shapes (what the smoke test runs)

For every (batch, context) case it times each implementation the ``kernels_pallas`` dispatcher offers on
this backend (``pallas_gpu`` or ``pallas_tpu`` beside ``reference``; only ``reference`` on CPU) and an
``xla_dense`` baseline (plain jnp attention over a contiguous ``[B, S, Hkv, D]`` cache holding the same
K/V), then a ragged-prefill section over a packed batch. See benchmarks/README.md for the columns.

This is a measurement tool, not a test: it asserts nothing about speed. It does record each output's max
abs difference from the reference so a fast-but-wrong kernel is visible in the same table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

import kernels_pallas

XLA_DENSE = "xla_dense"
REFERENCE = "reference"
DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32}

# Flag defaults. Every shape/iteration flag defaults to None so that --quick can substitute its own value
# for the flags the user did not give, while explicit flags still win (e.g. `--quick --dtype float32`).
FULL_DEFAULTS: dict[str, Any] = dict(
    batch="1,8,64",
    context="512,2048,8192",
    heads=32,
    kv_heads=8,
    head_dim=128,
    page_size=16,
    dtype="bfloat16",
    prefill_seqs="1,8",
    prefill_len="512,2048",
    prefill_prefix=0,
    warmup=3,
    iters=20,
)
QUICK_DEFAULTS: dict[str, Any] = dict(
    batch="1,3",
    context="100",
    heads=4,
    kv_heads=2,
    head_dim=32,
    page_size=16,
    dtype="bfloat16",
    prefill_seqs="2",
    prefill_len="48",
    prefill_prefix=16,
    warmup=1,
    iters=3,
)

# Auto --inner: back-to-back calls per timed run until a run lasts about this long, so that on an
# accelerator the host's per-call dispatch cost (tens of µs) overlaps device work instead of being
# added to a kernel that itself runs for ~10 µs.
_TARGET_SAMPLE_S = 1e-3
_MAX_INNER = 100
# Inputs up to this many elements are drawn with numpy on the host, larger ones on the device.
_HOST_RANDOM_MAX_ELEMS = 1 << 24


# --- cases ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    heads: int
    kv_heads: int
    head_dim: int
    page_size: int
    dtype: Any

    @property
    def itemsize(self) -> int:
        return jnp.dtype(self.dtype).itemsize

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5


def near(rng: np.random.Generator, target: int, n: int) -> np.ndarray:
    """n random lengths in [target - target/8, target]: ragged like a real batch, but close to the target."""
    lo = max(1, target - target // 8)
    return rng.integers(lo, target + 1, size=n).astype(np.int32)


def shuffled_page_table(
    rng: np.random.Generator,
    kv_lens: np.ndarray,  # i32[R] tokens each row holds
    pages_per_seq: int,
    page_size: int,
) -> tuple[np.ndarray, int]:  # (i32[R, pages_per_seq], num_pages)
    """Page table over a pool sized exactly to the rows' used pages, with page ids randomly permuted.

    A permutation (not consecutive ids) makes each row's pages scattered through the pool as in a long-running
    engine, so no implementation gets an unrealistically contiguous read. Entries past a row's last used page
    are 0, as `jaxinfer.step.pack` leaves them.
    """
    used = -(-kv_lens // page_size)
    num_pages = int(used.sum())
    perm = rng.permutation(num_pages).astype(np.int32)
    table = np.zeros((len(kv_lens), pages_per_seq), np.int32)
    offsets = np.concatenate([[0], np.cumsum(used)])
    for r, n in enumerate(used):
        table[r, :n] = perm[offsets[r] : offsets[r + 1]]
    return table, num_pages


@partial(jax.jit, static_argnames=("num_q", "num_pages", "shape"))
def _device_random_inputs(
    key: jax.Array, *, num_q: int, num_pages: int, shape: Shape
) -> tuple[jax.Array, jax.Array, jax.Array]:
    kq, kk, kv = jax.random.split(key, 3)
    dims = (num_pages, shape.page_size, shape.kv_heads, shape.head_dim)
    q = jax.random.normal(kq, (num_q, shape.heads, shape.head_dim), shape.dtype)
    return q, jax.random.normal(kk, dims, shape.dtype), jax.random.normal(kv, dims, shape.dtype)


def random_inputs(
    rng: np.random.Generator, num_q: int, num_pages: int, shape: Shape
) -> tuple[jax.Array, jax.Array, jax.Array]:  # q f[num_q, Hq, D], k_pages, v_pages f[num_pages, ps, Hkv, D]
    """Random-normal queries and K/V pool, in the target dtype on the device."""
    dims = (num_pages, shape.page_size, shape.kv_heads, shape.head_dim)
    elems = (num_q * shape.heads + 2 * math.prod(dims[:-1])) * shape.head_dim
    if elems > _HOST_RANDOM_MAX_ELEMS:
        # Big pools are drawn on the device so multi-GiB never pass through host memory (numpy would also
        # take tens of seconds for the largest default case).
        key = jax.random.key(int(rng.integers(1 << 31)))
        return _device_random_inputs(key, num_q=num_q, num_pages=num_pages, shape=shape)

    # Small ones on the host: the device generator costs a compilation per shape (~1 s of threefry on a
    # small CPU), which would dominate --quick and the smoke test.
    def draw(*dims: int) -> jax.Array:
        return jnp.asarray(rng.standard_normal(dims, dtype=np.float32).astype(shape.dtype))

    return draw(num_q, shape.heads, shape.head_dim), draw(*dims), draw(*dims)


# --- implementations -----------------------------------------------------------------------------------


def backend_impls(backend: str) -> list[str]:
    """The dispatcher impls worth timing on this backend, then the dense XLA baseline."""
    # On CPU "cpu" is the numba kernel for float32 (the jnp path otherwise, then "cpu_jnp" is the same and not timed).
    kernel = {"gpu": ["pallas_gpu"], "tpu": ["pallas_tpu"], "cpu": ["cpu", "cpu_jnp"]}.get(backend, [])
    return [*kernel, REFERENCE, XLA_DENSE]


def dense_decode_attention(
    q: jax.Array,  # f[B, Hq, D]
    k: jax.Array,  # f[B, S, Hkv, D] contiguous cache
    v: jax.Array,  # f[B, S, Hkv, D]
    lengths: jax.Array,  # i32[B] (>= 1 here)
    *,
    scale: float,
) -> jax.Array:  # f[B, Hq, D]
    """What plain XLA does with a contiguous cache: two einsums and a masked softmax, default precision.

    P is cast to the cache dtype before P@V, as a typical fast implementation does (the reference keeps f32).
    """
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    qg = q.reshape(batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    logits = jnp.einsum("bhgd,bshd->bhgs", qg, k, preferred_element_type=jnp.float32) * scale
    live = jnp.arange(k.shape[1], dtype=jnp.int32)[None, :] < lengths[:, None]
    logits = jnp.where(live[:, None, None, :], logits, -jnp.inf)
    p = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bhgs,bshd->bhgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(batch, num_q_heads, head_dim).astype(q.dtype)


@jax.jit
def densify(
    k_pages: jax.Array,  # f[num_pages, ps, Hkv, D]
    v_pages: jax.Array,
    page_table: jax.Array,  # i32[B, P]
) -> tuple[jax.Array, jax.Array]:  # f[B, P * ps, Hkv, D] each
    # Padding table entries (page 0) fill the slots past each length; the baseline masks them.
    b, p = page_table.shape

    def one(pages: jax.Array) -> jax.Array:
        return jnp.take(pages, page_table, axis=0).reshape(b, p * pages.shape[1], *pages.shape[2:])

    return one(k_pages), one(v_pages)


# --- timing --------------------------------------------------------------------------------------------


@dataclass
class Timing:
    compile_s: float
    median_s: float
    min_s: float
    max_s: float
    inner: int
    first_call_s: float
    out: jax.Array


def time_fn(fn: Callable[..., jax.Array], args: tuple[Any, ...], *, warmup: int, iters: int, inner: int) -> Timing:
    """Compile once (timed separately), warm up, then `iters` timed runs of `inner` back-to-back calls each."""
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    compile_s = time.perf_counter() - t0

    # The first run is kept out of the warm-up statistics: it may allocate, autotune or load modules.
    t0 = time.perf_counter()
    out = jax.block_until_ready(compiled(*args))
    first_call_s = time.perf_counter() - t0
    t_call = 0.0
    for _ in range(max(1, warmup)):
        t0 = time.perf_counter()
        out = jax.block_until_ready(compiled(*args))
        t_call = time.perf_counter() - t0
    if inner <= 0:
        inner = int(min(_MAX_INNER, max(1, math.ceil(_TARGET_SAMPLE_S / max(t_call, 1e-9)))))

    samples = []
    for _ in range(max(1, iters)):
        t0 = time.perf_counter()
        for _ in range(inner):
            res = compiled(*args)
        jax.block_until_ready(res)
        samples.append((time.perf_counter() - t0) / inner)
    return Timing(compile_s, statistics.median(samples), min(samples), max(samples), inner, first_call_s, out)


def _try_time(
    fn: Callable[..., jax.Array],
    args: tuple[Any, ...],
    label: str,
    notes: list[str],
    warmup: int,
    iters: int,
    inner: int,
) -> Timing | None:
    # A kernel that fails to compile or run on a freshly lent accelerator should cost its own row, not the
    # reference and baseline figures of the whole run; the failure is printed as a note and kept in the JSON.
    try:
        return time_fn(fn, args, warmup=warmup, iters=iters, inner=inner)
    except Exception as e:  # reported as a note, not swallowed
        first_line = (str(e).strip().splitlines() or [""])[0][:300]
        notes.append(f"{label} FAILED: {type(e).__name__}: {first_line}")
        print(f"note: {notes[-1]}", file=sys.stderr, flush=True)
        return None


def max_abs_diff(a: jax.Array, b: jax.Array) -> float:
    # On the host: outputs are q-sized, and eager jnp ops would each cost a compilation per shape.
    return float(np.max(np.abs(np.asarray(a).astype(np.float32) - np.asarray(b).astype(np.float32)), initial=0.0))


def _free(*arrays: jax.Array | None) -> None:
    # Release device buffers now rather than when Python gets round to it, so consecutive large cases
    # never hold two pools at once.
    for a in arrays:
        if a is not None and not a.is_deleted():
            a.delete()


def measure_order(impls: list[str]) -> list[str]:
    # The reference goes first: it is the base of every ratio, and an impl that falls back to it (e.g.
    # pallas_tpu for ragged prefill) is then reported as a duplicate instead of taking its place.
    return sorted(impls, key=lambda impl: impl != REFERENCE)


def _attach_ratios(rows: list[dict[str, Any]], outs: dict[str, jax.Array]) -> None:
    ref = next((r for r in rows if r["kernel"] == REFERENCE), None)
    for r in rows:
        r["speedup_vs_reference"] = ref["median_s"] / r["median_s"] if ref else None
        r["max_abs_diff_vs_reference"] = max_abs_diff(outs[r["impl"]], outs[ref["impl"]]) if ref else None


# --- decode --------------------------------------------------------------------------------------------


def bench_decode_case(
    rng: np.random.Generator,
    batch: int,
    context: int,
    shape: Shape,
    impls: list[str],
    *,
    warmup: int,
    iters: int,
    inner: int,
) -> tuple[list[dict[str, Any]], list[str]]:
    lengths_np = near(rng, context, batch)
    pages_per_seq = -(-context // shape.page_size)
    table_np, num_pages = shuffled_page_table(rng, lengths_np, pages_per_seq, shape.page_size)
    q, k_pages, v_pages = random_inputs(rng, batch, num_pages, shape)
    page_table, lengths = jnp.asarray(table_np), jnp.asarray(lengths_np)

    kv_bytes = int(lengths_np.sum()) * shape.kv_heads * shape.head_dim * 2 * shape.itemsize
    qo_bytes = 2 * batch * shape.heads * shape.head_dim * shape.itemsize

    rows: list[dict[str, Any]] = []
    outs: dict[str, jax.Array] = {}
    notes: list[str] = []
    seen: dict[str, str] = {}
    k_dense = v_dense = None
    for impl in measure_order(impls):
        if impl == XLA_DENSE:
            kernel = XLA_DENSE
            # The dense cache is built only for this baseline and outside the timing: it is the same data,
            # laid out as a contiguous-cache engine would hold it.
            k_dense, v_dense = densify(k_pages, v_pages, page_table)
            fn = partial(dense_decode_attention, scale=shape.scale)
            args = (q, k_dense, v_dense, lengths)
        else:
            kernel = kernels_pallas.decode_implementation(q, k_pages, v_pages, impl=impl)
            fn = partial(kernels_pallas.paged_decode_attention, scale=shape.scale, impl=impl)
            args = (q, k_pages, v_pages, page_table, lengths)
        if kernel in seen:
            notes.append(f"decode B={batch} ctx={context}: {impl} runs {kernel} (same as {seen[kernel]}); not timed")
            continue
        seen[kernel] = impl
        t = _try_time(fn, args, f"decode B={batch} ctx={context}: {impl}", notes, warmup, iters, inner)
        if t is None:
            continue
        outs[impl] = t.out
        rows.append(
            dict(
                impl=impl,
                kernel=kernel,
                batch=batch,
                context=context,
                mean_len=float(lengths_np.mean()),
                num_pages=num_pages,
                bytes=kv_bytes + qo_bytes,
                median_s=t.median_s,
                min_s=t.min_s,
                max_s=t.max_s,
                inner=t.inner,
                compile_s=t.compile_s,
                first_call_s=t.first_call_s,
                gb_per_s=(kv_bytes + qo_bytes) / t.median_s / 1e9,
            )
        )
        if impl == XLA_DENSE:
            _free(k_dense, v_dense)
    _attach_ratios(rows, outs)
    _free(k_pages, v_pages, q, *outs.values())
    return rows, notes


# --- ragged prefill ------------------------------------------------------------------------------------


def prefill_flops(q_lens: np.ndarray, ctx_lens: np.ndarray, shape: Shape) -> int:
    """Causal attention FLOPs actually needed: each query at position p reads p + 1 keys, QK^T and PV each
    2 * D FLOPs per (query head, key)."""
    prefix = (ctx_lens - q_lens).astype(np.int64)
    q64 = q_lens.astype(np.int64)
    keys = int(np.sum(q64 * prefix + q64 * (q64 + 1) // 2))
    return 4 * shape.heads * shape.head_dim * keys


def bench_prefill_case(
    rng: np.random.Generator,
    num_seqs: int,
    q_len: int,
    prefix: int,
    shape: Shape,
    impls: list[str],
    *,
    warmup: int,
    iters: int,
    inner: int,
) -> tuple[list[dict[str, Any]], list[str]]:
    q_lens = near(rng, q_len, num_seqs)
    prefixes = near(rng, prefix, num_seqs) if prefix > 0 else np.zeros(num_seqs, np.int32)
    ctx_lens = (prefixes + q_lens).astype(np.int32)
    pages_per_seq = -(-(prefix + q_len) // shape.page_size)
    table_np, num_pages = shuffled_page_table(rng, ctx_lens, pages_per_seq, shape.page_size)
    qsl_np = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    num_tokens = int(qsl_np[-1])

    # The new tokens' K/V count as already written to the pool, as when the engine calls this op.
    q, k_pages, v_pages = random_inputs(rng, num_tokens, num_pages, shape)
    args = (q, k_pages, v_pages, jnp.asarray(table_np), jnp.asarray(ctx_lens), jnp.asarray(qsl_np))
    args = (*args, jnp.asarray(np.int32(num_seqs)))
    flops = prefill_flops(q_lens, ctx_lens, shape)

    rows: list[dict[str, Any]] = []
    outs: dict[str, jax.Array] = {}
    notes: list[str] = []
    seen: dict[str, str] = {}
    for impl in measure_order(impls):
        if impl == XLA_DENSE:
            continue  # decode-only baseline
        kernel = kernels_pallas.ragged_implementation(q, k_pages, v_pages, impl=impl)
        if kernel in seen:
            notes.append(
                f"prefill seqs={num_seqs} len={q_len}: {impl} runs {kernel} (same as {seen[kernel]}); not timed"
            )
            continue
        seen[kernel] = impl
        fn = partial(kernels_pallas.ragged_paged_attention, scale=shape.scale, impl=impl)
        t = _try_time(fn, args, f"prefill seqs={num_seqs} len={q_len}: {impl}", notes, warmup, iters, inner)
        if t is None:
            continue
        outs[impl] = t.out
        rows.append(
            dict(
                impl=impl,
                kernel=kernel,
                num_seqs=num_seqs,
                q_len=q_len,
                prefix=prefix,
                num_tokens=num_tokens,
                mean_context=float(ctx_lens.mean()),
                flops=flops,
                median_s=t.median_s,
                min_s=t.min_s,
                max_s=t.max_s,
                inner=t.inner,
                compile_s=t.compile_s,
                first_call_s=t.first_call_s,
                tokens_per_s=num_tokens / t.median_s,
                tflop_per_s=flops / t.median_s / 1e12,
            )
        )
    _attach_ratios(rows, outs)
    _free(*(a for a in args if isinstance(a, jax.Array)), *outs.values())
    return rows, notes


# --- output --------------------------------------------------------------------------------------------


def format_table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _err(x: float | None) -> str:
    return "-" if x is None else f"{x:.1e}"


def decode_table(rows: list[dict[str, Any]]) -> str:
    headers = ["impl", "kernel", "B", "ctx", "mean_len", "ms", "min_ms", "GB/s", "vs_ref", "compile_s", "err"]
    body = [
        [
            r["impl"],
            r["kernel"],
            str(r["batch"]),
            str(r["context"]),
            f"{r['mean_len']:.0f}",
            f"{r['median_s'] * 1e3:.3f}",
            f"{r['min_s'] * 1e3:.3f}",
            f"{r['gb_per_s']:.2f}",
            _ratio(r["speedup_vs_reference"]),
            f"{r['compile_s']:.2f}",
            _err(r["max_abs_diff_vs_reference"]),
        ]
        for r in rows
    ]
    return format_table(headers, body)


def prefill_table(rows: list[dict[str, Any]]) -> str:
    headers = ["impl", "kernel", "seqs", "len", "prefix", "tokens", "ms", "tok/s", "TFLOP/s", "vs_ref", "compile_s"]
    headers.append("err")
    body = [
        [
            r["impl"],
            r["kernel"],
            str(r["num_seqs"]),
            str(r["q_len"]),
            str(r["prefix"]),
            str(r["num_tokens"]),
            f"{r['median_s'] * 1e3:.3f}",
            f"{r['tokens_per_s']:.0f}",
            f"{r['tflop_per_s']:.4f}",
            _ratio(r["speedup_vs_reference"]),
            f"{r['compile_s']:.2f}",
            _err(r["max_abs_diff_vs_reference"]),
        ]
        for r in rows
    ]
    return format_table(headers, body)


# --- CLI -----------------------------------------------------------------------------------------------


def int_list(text: str) -> list[int]:
    """A comma list of positive ints (the benchmarks' shape flags)."""
    vals = [int(x) for x in str(text).split(",") if x.strip()]
    if not vals or min(vals) <= 0:
        raise argparse.ArgumentTypeError(f"expected a comma list of positive ints, got {text!r}")
    return vals


def fill_defaults(args: argparse.Namespace, quick: dict[str, Any], full: dict[str, Any]) -> None:
    """Sets every flag left unset (None) to its `--quick` or full-run default (the benchmarks' shared scheme)."""
    for name, value in (quick if args.quick else full).items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_attention", description=__doc__.split("\n")[0])
    shaped = [
        ("--batch", str, "decode batch sizes (comma list)"),
        ("--context", str, "decode context lengths (comma list)"),
        ("--heads", int, "query heads"),
        ("--kv-heads", int, "KV heads (GQA: --heads must be a multiple)"),
        ("--head-dim", int, "head dimension"),
        ("--page-size", int, "tokens per KV page"),
        ("--dtype", str, f"q/K/V dtype, one of {sorted(DTYPES)}"),
        ("--prefill-seqs", str, "ragged prefill: sequences per packed batch (comma list)"),
        ("--prefill-len", str, "ragged prefill: new tokens per sequence (comma list)"),
        ("--prefill-prefix", int, "ragged prefill: tokens already cached before the new ones"),
        ("--warmup", int, "untimed calls after the first call"),
        ("--iters", int, "timed runs; the median is reported"),
    ]
    for flag, typ, text in shaped:
        name = flag[2:].replace("-", "_")
        p.add_argument(flag, type=typ, help=f"{text} (default {FULL_DEFAULTS[name]}; --quick {QUICK_DEFAULTS[name]})")
    p.add_argument("--inner", type=int, default=0, help="calls per timed run (0: auto, ~1 ms per run)")
    p.add_argument("--impls", help="comma list overriding the backend's default implementations")
    p.add_argument("--sections", default="decode,prefill", help="sections to run, a comma list: decode, prefill")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny shapes and few iterations: a seconds-long run")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)

    fill_defaults(args, QUICK_DEFAULTS, FULL_DEFAULTS)
    for name in ("batch", "context", "prefill_seqs", "prefill_len"):
        setattr(args, name, int_list(getattr(args, name)))
    if args.dtype not in DTYPES:
        p.error(f"--dtype {args.dtype!r}: expected one of {sorted(DTYPES)}")
    if args.heads % args.kv_heads:
        p.error(f"--heads {args.heads} is not a multiple of --kv-heads {args.kv_heads}")
    args.sections = [s for s in args.sections.split(",") if s]
    if not set(args.sections) <= {"decode", "prefill"}:
        p.error(f"--sections: unknown section in {args.sections}")
    args.impls = args.impls.split(",") if args.impls else backend_impls(jax.default_backend())
    unknown = set(args.impls) - {*kernels_pallas.IMPLS, XLA_DENSE}
    if unknown:
        p.error(f"--impls: unknown {sorted(unknown)}; expected {[*kernels_pallas.IMPLS, XLA_DENSE]}")
    return args


def metadata(args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    dev = jax.devices()[0]
    return dict(
        device_kind=dev.device_kind,
        platform=dev.platform,
        device_count=jax.device_count(),
        jax_version=jax.__version__,
        jaxlib_version=jaxlib.__version__,
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        host=dict(cpu_count=os.cpu_count(), machine=platform.machine(), python=platform.python_version()),
        command=" ".join(["python -m benchmarks.bench_attention", *argv]),
        config={k: v for k, v in vars(args).items() if k != "out"},
    )


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    shape = Shape(args.heads, args.kv_heads, args.head_dim, args.page_size, DTYPES[args.dtype])
    meta = metadata(args, argv)
    print(
        f"device: {meta['device_kind']} ({meta['platform']}), jax {meta['jax_version']}, {meta['date']}\n"
        f"Hq={shape.heads} Hkv={shape.kv_heads} D={shape.head_dim} page={shape.page_size} {args.dtype}, "
        f"impls: {','.join(args.impls)}, warmup {args.warmup}, iters {args.iters}",
        flush=True,
    )
    rng = np.random.default_rng(args.seed)
    timing = dict(warmup=args.warmup, iters=args.iters, inner=args.inner)
    decode_rows: list[dict[str, Any]] = []
    prefill_rows: list[dict[str, Any]] = []
    notes: list[str] = []

    if "decode" in args.sections:
        for batch in args.batch:
            for context in args.context:
                rows, n = bench_decode_case(rng, batch, context, shape, args.impls, **timing)
                decode_rows += rows
                notes += n
        print("\n== decode (one query token per row; GB/s = live K/V + q + out bytes / median time)")
        print(decode_table(decode_rows), flush=True)

    if "prefill" in args.sections:
        for num_seqs in args.prefill_seqs:
            for q_len in args.prefill_len:
                rows, n = bench_prefill_case(rng, num_seqs, q_len, args.prefill_prefix, shape, args.impls, **timing)
                prefill_rows += rows
                notes += n
        print("\n== ragged prefill (packed batch, causal; TFLOP/s counts only unmasked QK^T and PV work)")
        print(prefill_table(prefill_rows), flush=True)

    for note in notes:
        print(f"note: {note}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, decode=decode_rows, prefill=prefill_rows, notes=notes), f, indent=1)
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
