"""The CPU's dot libraries at a model's projection shapes: XLA:CPU's dot as the engine's steps compile it (YNNPACK
in jax 0.10.2), against PyTorch's (MKL) and numpy's (OpenBLAS) on the same operands, in one process.

    python -m benchmarks.bench_dots --out dots.json                       # SmolLM2-135M, rows 8,128,512
    python -m benchmarks.bench_dots --shape qwen3-0.6b --rows 1,64 \
        --options xla_cpu_experimental_ynn_fusion_type= \
        xla_cpu_experimental_onednn_fusion_type=LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT

On CPU the engine's big steps are bound by these products (a 128-row decode step of the default model is ~60%
dots, a prompt step ~85%), so how fast XLA:CPU's library runs them against the one transformers uses decides the
ratio to transformers on a machine (benchmarks/README.md, issue #14). Each product x f32[rows, in] @ W^T, W
f32[out, in] (output-major, as the engine stores kernels) runs `--chain` times inside one call (XLA: one compiled
program chaining the products, so dispatch is amortized; the others: a Python loop), and the table has GFLOP/s
(best of `--repeats`) and each library's speed relative to XLA (> 1: faster than XLA). W stays hot in the caches
between products, as it does not in a step at one row; the rows >= 8 are compute-bound and comparable.
`--options NAME=VALUE` adds an XLA:CPU compile option as a second XLA column (a library route to try; the column
says which library the optimized module calls: ynn, xnn, onednn, or xla for XLA's own emitters).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import operator
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import SHAPES, cpu_flags, format_table, int_list, metadata, time_calls


def projections(shape: str) -> dict[str, tuple[int, int]]:
    """(out, in) of the shape's projections: the fused QKV, the attention output, gate and up fused, down, and the
    LM head."""
    s = SHAPES[shape]
    d, f, hd = s["hidden_size"], s["intermediate_size"], s["head_dim"]
    q, kv = s["num_heads"] * hd, s["num_kv_heads"] * hd
    return {"qkv": (q + 2 * kv, d), "o": (d, q), "gate_up": (2 * f, d), "down": (d, f), "lm_head": (s["vocab_size"], d)}


def option_value(text: str) -> bool | int | str:
    """An XLA compile option's value from the command line: XLA refuses "true" for a bool option, so booleans and
    integers are converted; anything else (an enum's name, a list) stays a string."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        return int(text)
    except ValueError:
        return text


def _library(hlo: str) -> str:
    for tag, name in (("__ynn", "ynn"), ("__xnn", "xnn"), ("onednn", "onednn")):
        if tag in hlo:
            return name
    return "xla"


def xla_seconds(x: np.ndarray, w: np.ndarray, chain: int, repeats: int, options: dict[str, Any]) -> tuple[float, str]:
    """Seconds per product of XLA's compiled chain, and the library its optimized module calls."""

    def chained(x: jax.Array, w: jax.Array) -> jax.Array:
        acc = jnp.float32(0.0)
        for _ in range(chain):  # each product's input depends on the last one's result: none can be skipped
            y = jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())))
            acc = acc + y[0, 0]
            x = x + acc * 1e-30
        return acc

    xd, wd = jnp.asarray(x), jnp.asarray(w)
    compiled = jax.jit(chained).lower(xd, wd).compile(compiler_options=options or None)
    samples = time_calls(lambda: compiled(xd, wd).block_until_ready(), 0, repeats)[2]  # the first call untimed
    return min(samples) / chain, _library(compiled.as_text())


def loop_seconds(product: Callable[[Any, Any], Any], a: Any, b: Any, chain: int, repeats: int) -> float:
    def run() -> None:
        for _ in range(chain):
            product(a, b)

    return min(time_calls(run, 0, repeats)[2]) / chain


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    rng = np.random.default_rng(0)
    torch = None
    if importlib.util.find_spec("torch") is not None:
        import torch

        torch.set_num_threads(args.threads or torch.get_num_threads())
    options = {name: option_value(value) for name, _, value in (o.partition("=") for o in args.options)}
    rows = []
    for name, (n_out, n_in) in projections(args.shape).items():
        w = rng.standard_normal((n_out, n_in), np.float32)
        for m in int_list(args.rows):
            x = rng.standard_normal((m, n_in), np.float32)
            flop = 2.0 * m * n_in * n_out
            row: dict[str, Any] = dict(proj=name, rows=m, out=n_out, inp=n_in)
            xla_s, row["xla_lib"] = xla_seconds(x, w, args.chain, args.repeats, {})
            row["xla_gflops"] = flop / xla_s / 1e9
            if options:
                opt_s, row["opt_lib"] = xla_seconds(x, w, args.chain, args.repeats, options)
                row["opt_gflops"] = flop / opt_s / 1e9
            if torch is not None:
                with torch.inference_mode():
                    tx, twt = torch.from_numpy(x), torch.from_numpy(w).T  # MKL reads the transposed view in place
                    row["torch_gflops"] = flop / loop_seconds(operator.matmul, tx, twt, args.chain, args.repeats) / 1e9
            wt = np.ascontiguousarray(w.T)  # numpy would copy a transposed view on every call
            row["numpy_gflops"] = flop / loop_seconds(operator.matmul, x, wt, args.chain, args.repeats) / 1e9
            rows.append(row)
            print(f"  {name} rows={m} done", flush=True)
    return rows


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_dots", description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="smollm2-135m", choices=list(SHAPES), help="the model whose projections run")
    p.add_argument("--rows", default="8,128,512", help="rows of x (comma list)")
    p.add_argument("--chain", type=int, default=20, help="products per timed call")
    p.add_argument("--repeats", type=int, default=5, help="timed calls; the best is reported")
    p.add_argument("--threads", type=int, help="torch's threads (default: its own count)")
    p.add_argument("--options", nargs="*", default=[], help="XLA:CPU compile options NAME=VALUE: a second XLA column")
    p.add_argument("--quick", action="store_true", help="the tiny shape, few repeats: a seconds-long run")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.quick:
        args.shape, args.rows, args.chain, args.repeats = "tiny", "2,16", 2, 2
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}, cpu flags: {' '.join(cpu_flags())}")
    rows = measure(args)
    others = [c for c in ("opt", "torch", "numpy") if f"{c}_gflops" in rows[0]]
    headers = ["proj", "rows", "out x in", "xla lib", "xla GF/s"]
    headers += [h for c in others for h in (f"{c} GF/s", f"{c}/xla")] + (["opt lib"] if "opt" in others else [])
    body = []
    for r in rows:
        line = [r["proj"], str(r["rows"]), f"{r['out']} x {r['inp']}", r["xla_lib"], f"{r['xla_gflops']:.1f}"]
        for c in others:
            line += [f"{r[c + '_gflops']:.1f}", f"{r[c + '_gflops'] / r['xla_gflops']:.2f}x"]
        body.append(line + ([r["opt_lib"]] if "opt" in others else []))
    print("\n== GFLOP/s per product (best of repeats); library/xla > 1: faster than XLA:CPU's dot")
    print(format_table(headers, body))
    if args.out:
        meta = metadata("benchmarks.bench_dots", args, sys.argv[1:] if argv is None else list(argv))
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)  # meta["host"] names the CPU flags
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
