"""Launch-parameter sweep of the GPU paged decode kernel (kernels_pallas/decode_gpu.py): KV block size, warps and
pipeline stages, then the split count, at the bench_attention shapes. Prints GB/s and the share of the measured copy
bandwidth per configuration and the best one per shape; a measurement tool for choosing the kernel's defaults.

    python -m benchmarks.sweep_decode_gpu --out sweep.json          # on a GPU (Triton); minutes

Configurations the compiler rejects (shared memory, registers) are listed as failed, not timed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import roofline
from benchmarks.bench_attention import Shape, format_table, near, random_inputs, shuffled_page_table, time_fn
from kernels_pallas import decode_gpu


def _case(rng: np.random.Generator, batch: int, context: int, shape: Shape) -> tuple[tuple, int]:
    lengths = near(rng, context, batch)
    table, num_pages = shuffled_page_table(rng, lengths, -(-context // shape.page_size), shape.page_size)
    q, k, v = random_inputs(rng, batch, num_pages, shape)
    live = int(lengths.sum()) * shape.kv_heads * shape.head_dim * 2 * shape.itemsize
    return (q, k, v, jnp.asarray(table), jnp.asarray(lengths)), live + 2 * q.size * shape.itemsize


def _time(args: tuple, shape: Shape, nbytes: int, **kw: Any) -> dict[str, Any]:
    fn = partial(decode_gpu.paged_decode_attention, scale=shape.scale, **kw)
    try:
        t = time_fn(fn, args, warmup=3, iters=15, inner=0)
    except Exception as e:  # noqa: BLE001 -- a rejected configuration is a result of the sweep, reported as such
        return dict(kw, failed=f"{type(e).__name__}: {str(e).splitlines()[0][:120]}")
    return dict(kw, median_s=t.median_s, gb_per_s=nbytes / t.median_s / 1e9, out=t.out)


def _best(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The fastest configuration that compiled ({} if none did)."""
    return max((r for r in rows if "gb_per_s" in r), key=lambda r: r["gb_per_s"], default={})


def _plain(r: dict[str, Any]) -> dict[str, Any]:
    """A result without its output array (for printing and JSON)."""
    return {k: v for k, v in r.items() if k != "out"}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sweep_decode_gpu", description=__doc__.split("\n")[0])
    p.add_argument("--cases", default="1:2048,8:2048,64:2048,8:8192,64:8192", help="B:context, comma list")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--block-kv", default="64,128,256")
    p.add_argument("--num-warps", default="4,8")
    p.add_argument("--num-stages", default="2,3,4")
    p.add_argument("--splits", default="1,2,4,8,16", help="split counts tried with each case's best launch params")
    p.add_argument("--out")
    args = p.parse_args(argv)
    if jax.default_backend() != "gpu":
        p.error("needs a GPU: the kernel is compiled by Triton")
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    shape = Shape(args.heads, args.kv_heads, args.head_dim, args.page_size, jnp.bfloat16)
    bw = roofline.measure_copy_bandwidth()
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}; copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    rng = np.random.default_rng(0)
    results: list[dict[str, Any]] = []
    for case in args.cases.split(","):
        batch, context = (int(x) for x in case.split(":"))
        inputs, nbytes = _case(rng, batch, context, shape)
        default = _time(inputs, shape, nbytes)
        rows = []
        for bkv, warps, stages in itertools.product(ints(args.block_kv), ints(args.num_warps), ints(args.num_stages)):
            rows.append(_time(inputs, shape, nbytes, block_kv=bkv, num_warps=warps, num_stages=stages))
        best = _best(rows)
        launch = {k: best[k] for k in ("block_kv", "num_warps", "num_stages")} if best else {}
        for s in ints(args.splits) if best else []:
            rows.append(_time(inputs, shape, nbytes, num_splits=s, **launch))
        best = _best(rows)
        if best and "out" in default:
            err = float(jnp.max(jnp.abs(best["out"].astype(jnp.float32) - default["out"].astype(jnp.float32))))
            best["max_abs_diff_vs_default"] = err
        table = [
            [str(r.get("block_kv", "-")), str(r.get("num_warps", "-")), str(r.get("num_stages", "-")),
             str(r.get("num_splits", "auto")), f"{r['gb_per_s']:.0f}" if "gb_per_s" in r else r["failed"][:60],
             f"{100 * r['gb_per_s'] * 1e9 / bw:.0f}%" if "gb_per_s" in r else "-"]
            for r in rows
        ]  # fmt: skip
        print(f"\n== B={batch} ctx={context}: default {default.get('gb_per_s', 0):.0f} GB/s "
              f"({100 * default.get('gb_per_s', 0) * 1e9 / bw:.0f}%)")  # fmt: skip
        print(format_table(["block_kv", "warps", "stages", "splits", "GB/s", "of copy"], table))
        print(f"best: {_plain(best)}", flush=True)
        results.append(dict(batch=batch, context=context, bytes=nbytes, default=_plain(default), best=_plain(best),
                            rows=[_plain(r) for r in rows]))  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, copy_bw=bw, cases=results), f,
                      indent=1)  # fmt: skip
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
