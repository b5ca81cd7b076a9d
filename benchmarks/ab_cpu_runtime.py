"""CPU runtime settings A/B: each setting in its own process, the same steps timed, side by side.

    python -m benchmarks.ab_cpu_runtime --out ab_runtime.json
    python -m benchmarks.ab_cpu_runtime --variants default,xla_dots --rounds 2

Each variant runs `benchmarks.bench_latency` (the default model, f32, the engine's own compiled steps) in a fresh
child process with its changes (XLA flags, jax settings, CPU affinity, bench_latency flags such as the layer
loop), and
reports the bare step time (`paged_step` alone, median) of a 256-token prefill and of batch-1 and batch-32 decode
steps at about 200 tokens of context, and each one's ratio to `default` (> 1: faster than the default). `--rounds`
repeats the whole list in turn, so a shared machine's drift falls on every variant alike; the best round counts.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from benchmarks.common import format_table, load_avg

# name -> (environment changes, what it tries). XLA_FLAGS values are appended to the caller's.
VARIANTS: dict[str, tuple[dict[str, str], str]] = {
    "default": ({}, "as shipped"),
    # `--xla_cpu_use_onednn=true` is not a variant: YNNPACK claims the dots first, and the optimized module is the
    # default's (jax 0.10.2); with YNNPACK's single dots off (`xla_dots`) they go to XLA's own dot, not oneDNN.
    "xla_dots": (
        {"XLA_FLAGS": "--xla_cpu_experimental_ynn_fusion_type=-individual_dot"},
        "single dots to XLA's own emitter instead of YNNPACK",
    ),
    "ynn_dot": (
        {"XLA_FLAGS": "--xla_cpu_experimental_ynn_fusion_type=dot"},
        "YNNPACK for dot fusions only (single dots leave it)",
    ),
    "ynn_all": (
        {"XLA_FLAGS": "--xla_cpu_experimental_ynn_fusion_type=dot,eltwise,reduce"},
        "YNNPACK dot, elementwise and reduce fusions",
    ),
    "xnn_greedy": (
        {"XLA_FLAGS": "--xla_cpu_experimental_xnn_graph_fusion_mode=XNN_GRAPH_FUSION_MODE_GREEDY"},
        "XNNPACK graph fusion",
    ),
    "vec512": ({"XLA_FLAGS": "--xla_cpu_prefer_vector_width=512"}, "512-bit vectors in XLA's own loops"),
    "eigen_1thread": ({"XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false"}, "single-threaded Eigen ops"),
    "sync_dispatch": ({"JAX_CPU_ENABLE_ASYNC_DISPATCH": "0"}, "jax's CPU async dispatch off"),
    "one_core": ({"_TASKSET": "0"}, "pinned to one core (one compute thread's worth)"),
    "scan_layers": ({"_ARGS": "--layer-loop scan"}, "lax.scan over stacked layers and KV pools"),
    "unroll_layers": ({"_ARGS": "--layer-loop unroll"}, "layers unrolled, a KV pool per layer"),
}

CASES = (("prefill", 256, "prefill T=256"), ("decode", 1, "decode B=1"), ("decode", 32, "decode B=32"))


def run_variant(name: str, args: argparse.Namespace) -> dict[str, float]:
    env_changes, _ = VARIANTS[name]
    env = dict(os.environ)
    cmd = [sys.executable, "-m", "benchmarks.bench_latency", "--prefill-len", "256", "--batch", "1,32",
           "--context", "200", "--iters", str(args.iters), "--warmup", "2"]  # fmt: skip
    for key, value in env_changes.items():
        if key == "XLA_FLAGS":
            env[key] = f"{env.get(key, '')} {value}".strip()
        elif key == "_TASKSET":
            cmd = ["taskset", "-c", value, *cmd]
        elif key == "_ARGS":
            cmd += value.split()
        else:
            env[key] = value
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "lat.json"
        proc = subprocess.run([*cmd, "--out", str(out)], env=env, capture_output=True, text=True,
                              timeout=args.timeout)  # fmt: skip
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            raise RuntimeError(f"variant {name} failed: {' / '.join(tail)}")
        data = json.loads(out.read_text())
    result = {}
    for section, size, label in CASES:
        key = "tokens" if section == "prefill" else "batch"
        (row,) = [r for r in data[section] if r[key] == size]
        result[label] = row["bare_s"] * 1e3
    return result


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ab_cpu_runtime", description=__doc__.split("\n")[0])
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    p.add_argument("--rounds", type=int, default=1, help="passes over the variant list; the best counts")
    p.add_argument("--iters", type=int, default=7)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per child")
    p.add_argument("--out", help="write the rows as JSON here")
    args = p.parse_args(argv)
    names = [n for n in args.variants.split(",") if n]
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        p.error(f"unknown variants {unknown}; known: {list(VARIANTS)}")
    if "default" not in names:
        names.insert(0, "default")
    best: dict[str, dict[str, float]] = {}
    errors: dict[str, str] = {}
    loads = [load_avg()]
    for r in range(args.rounds):
        for name in names:
            try:
                got = run_variant(name, args)
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                errors[name] = str(e)
                print(f"round {r + 1} {name}: {e}", flush=True)
                continue
            prev = best.setdefault(name, got)
            best[name] = {k: min(v, prev[k]) for k, v in got.items()}
            print(f"round {r + 1} {name}: " + ", ".join(f"{k} {v:.1f} ms" for k, v in got.items()), flush=True)
        loads.append(load_avg())
    labels = [c[2] for c in CASES]
    base = best.get("default")
    rows = []
    for name in names:
        if name not in best:
            continue
        row = [name] + [f"{best[name][k]:.1f}" for k in labels]
        row += [f"{base[k] / best[name][k]:.2f}x" if base else "-" for k in labels]
        rows.append(row + [VARIANTS[name][1]])
    head = ["variant", *(f"{k} ms" for k in labels), *(f"{k} vs default" for k in labels), "what"]
    print(format_table(head, rows))
    for name, err in errors.items():
        print(f"failed: {name}: {err}")
    print(f"load average before / after each round: {loads}")
    if args.out:
        meta = {n: dict(env=VARIANTS[n][0], what=VARIANTS[n][1]) for n in names}
        with open(args.out, "w") as f:
            json.dump(dict(variants=meta, ms=best, errors=errors, load_avg=loads, argv=list(argv or sys.argv[1:])), f,
                      indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
