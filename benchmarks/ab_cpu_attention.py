"""CPU attention A/B at the default engine's shapes: `kernels_pallas.cpu` vs the jnp reference, side by side.

    python -m benchmarks.ab_cpu_attention --out ab.json

SmolLM2-135M heads (9 query, 3 KV, head dim 64), f32, page 16, and the page-table width of a plain `LLM()`
(`max_model_len` 4096: 256 pages per row): decodes of batch 32, 8 and 1 over contexts of 150-384 tokens, a T=256
mixed step (31 decodes and a 225-token prefill), and a 512-token prefill. Prints ms per layer call (median), the
ratio, and the max difference.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import format_table, metadata
from kernels_pallas import cpu, reference

HQ, HKV, D, PAGE, WIDTH = 9, 3, 64, 16, 256


def _case(rng: np.random.Generator, lens: list[int], q_lens: list[int]) -> tuple:
    rows, pages = len(lens), len(lens) * WIDTH + 1
    kp = jnp.asarray(rng.standard_normal((pages, PAGE, HKV, D)), jnp.float32)
    table = jnp.asarray(rng.permutation(pages)[: rows * WIDTH].reshape(rows, WIDTH), jnp.int32)
    q = jnp.asarray(rng.standard_normal((sum(q_lens), HQ, D)), jnp.float32)
    qsl = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    return q, kp, kp * 0.5, table, jnp.asarray(lens, jnp.int32), qsl, jnp.int32(rows)


def _time(fn, args: tuple, iters: int) -> tuple[float, jax.Array]:
    fn = jax.jit(fn)
    out = fn(*args).block_until_ready()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn(*args).block_until_ready()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ab_cpu_attention", description=__doc__.split("\n")[0])
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--out", help="write the rows as JSON here")
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    decode = lambda m: lambda q, k, v, t, n, *_: m.paged_decode_attention(q, k, v, t, n, scale=0.125)
    ragged = lambda m: lambda *a: m.ragged_paged_attention(*a, scale=0.125)
    cases = {
        "decode B=32": (_case(rng, rng.integers(150, 384, 32).tolist(), [1] * 32), decode),
        "mixed T=256": (_case(rng, rng.integers(150, 384, 31).tolist() + [225], [1] * 31 + [225]), ragged),
        "decode B=8": (_case(rng, rng.integers(150, 384, 8).tolist(), [1] * 8), decode),
        "decode B=1": (_case(rng, [300], [1]), decode),
        "prefill T=512": (_case(rng, [512], [512]), ragged),
    }
    rows = []
    for name, (case, make) in cases.items():
        ref_s, ref_out = _time(make(reference), case, args.iters)
        cpu_s, cpu_out = _time(make(cpu), case, args.iters)
        diff = float(jnp.max(jnp.abs(cpu_out - ref_out)))
        rows.append(dict(case=name, reference_ms=ref_s * 1e3, cpu_ms=cpu_s * 1e3, speedup=ref_s / cpu_s, max_diff=diff))
    print(format_table(["case", "reference_ms", "cpu_ms", "speedup", "max_diff"],
                       [[r["case"], f"{r['reference_ms']:.2f}", f"{r['cpu_ms']:.2f}", f"{r['speedup']:.1f}x",
                         f"{r['max_diff']:.1e}"] for r in rows]))  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            meta = metadata("benchmarks.ab_cpu_attention", args, list(argv or []))
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
