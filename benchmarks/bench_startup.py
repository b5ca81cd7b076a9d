"""Start-up time of `python serve.py`: seconds until /health answers 200, cold and warm, and until every step
variant is ready (`all_s`: a start is ready once the plain buckets are, and compiles, or on a warm start loads, the
advanced sampling and prompt-logprobs variants while idle).

    python -m benchmarks.bench_startup                      # the default model, no flags: what a new user runs
    python -m benchmarks.bench_startup --serve-args "--max-model-len 512 --num-kv-tokens 4096" --out start.json

Cold: fresh, empty compilation (jax's and numba's) and conversion caches (temporary directories; each cold run its
own). Warm: the same command again, on the caches the last cold run filled. `warm-noexec`: warm with
JAXINFER_EXEC_CACHE=0 (only jax's persistent XLA cache, so every step is traced and lowered again): the executable
cache's share, side by side.
The engine process logs its start-up summary (load, buckets, compile seconds); the table puts those beside the
wall time to ready. Nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.bench_attention import format_table
from benchmarks.bench_serving import LaunchedServer, free_port
from benchmarks.common import host_metadata

REPO = Path(__file__).resolve().parents[1]


def start_once(serve_args: list[str], env: dict[str, str], log: Path, timeout: float) -> dict:
    port = free_port()
    cmd = [sys.executable, str(REPO / "serve.py"), "--port", str(port), *serve_args]
    server = LaunchedServer("serve.py", cmd, port, log, env)
    try:
        ready = server.wait_ready(timeout, poll=0.2)
        all_compiled = time.monotonic() - server.t0
    finally:
        server.stop()
    text = log.read_text()

    def grab(pattern: str) -> float | None:
        m = re.search(pattern, text)
        return float(m.group(1)) if m else None

    buckets = re.search(r"buckets\s+(\d+) compiled", text)
    deferred = re.search(r"(\d+) more variants load or compile while idle", text)
    return {
        "ready_s": round(ready, 2),
        "all_s": round(all_compiled, 2),
        "load_s": grab(r"model \S+ loaded in ([\d.]+)s"),
        "compile_s": grab(r"compiled steps warmed up in ([\d.]+)s"),
        "buckets": int(buckets.group(1)) if buckets else None,
        "deferred": int(deferred.group(1)) if deferred else 0,
        "kv": (re.search(r"KV cache\s+(.*)", text) or [None, None])[1],
    }


def cache_sets(runs: list[str]) -> list[int]:
    """Which set of caches each run starts on: every cold run a new, empty one; a warm run the last one (the first
    run's when no cold run came before it)."""
    sets, current = [], 0
    for i, run in enumerate(runs):
        if run == "cold":
            current = i
        sets.append(current)
    return sets


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_startup", description=__doc__.split("\n")[0])
    p.add_argument("--serve-args", default="", help="flags for serve.py, one string (default: none)")
    p.add_argument(
        "--runs",
        default="cold,warm,warm-noexec,warm",
        help="which starts, in order (default: cold,warm,warm-noexec,warm)",
    )
    p.add_argument("--timeout", type=float, default=1800, help="seconds to wait for /health (default: 1800)")
    p.add_argument("--out", default=None, help="JSON file for the results (default: none)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    rows = []
    runs = args.runs.split(",")
    with tempfile.TemporaryDirectory(prefix="jaxinfer-startup-") as tmp:
        for i, (run, fill) in enumerate(zip(runs, cache_sets(runs), strict=True)):
            caches = Path(tmp) / f"caches-{fill}"
            # NUMBA_CACHE_DIR: the CPU attention kernel's machine code too (kernels_pallas/ragged_cpu_numba.py), which
            # a new machine builds on its first start.
            env = {**os.environ, "PYTHONPATH": str(REPO), "JAXINFER_COMPILE_CACHE": f"{caches}/xla",
                   "JAXINFER_CACHE": f"{caches}/converted", "NUMBA_CACHE_DIR": f"{caches}/numba"}  # fmt: skip
            run_env = {**env, "JAXINFER_EXEC_CACHE": "0"} if run.endswith("-noexec") else env
            r = start_once(shlex.split(args.serve_args), run_env, Path(tmp) / f"{i}-{run}.log", args.timeout)
            rows.append({"run": run, **r})
            print(f"{run}: {r}", file=sys.stderr)
    cols = ["run", "ready_s", "all_s", "load_s", "compile_s", "buckets", "deferred"]
    print(format_table(cols, [[str(r[c]) for c in cols] for r in rows]))
    if rows:
        print(f"KV cache: {rows[-1]['kv']}")
    if args.out:
        Path(args.out).write_text(json.dumps({"meta": host_metadata("bench_startup", args, argv or sys.argv[1:]),
                                              "rows": rows}, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
