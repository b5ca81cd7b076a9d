"""Where a compiled step's device time goes: records a jax profiler trace of a few calls and tables the device's
kernels by total time (from the Perfetto JSON the profiler writes beside its XPlane file).

Used by `bench_latency --trace DIR`. On CPU the trace holds no device stream, and the table says so."""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
from collections.abc import Callable
from typing import Any

import jax

from benchmarks.common import format_table


def record(fn: Callable[[], Any], calls: int, log_dir: str) -> str | None:
    """Runs fn (which blocks until done) `calls` times under the profiler; returns the Perfetto trace path."""
    fn()  # compiled and warm before the trace starts
    with jax.profiler.trace(log_dir, create_perfetto_trace=True):
        for _ in range(calls):
            fn()
    found = sorted(glob.glob(os.path.join(log_dir, "**", "*.trace.json.gz"), recursive=True), key=os.path.getmtime)
    return found[-1] if found else None


def _events(trace_path: str) -> tuple[list[dict], dict[int, str]]:
    with gzip.open(trace_path, "rt") as f:
        events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    meta = [e for e in events if e.get("ph") == "M" and e.get("name") == "process_name"]
    return events, {e["pid"]: e.get("args", {}).get("name", "") for e in meta}


def _by_name(events: list[dict], pids: set[int]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in pids:
            out[e["name"]].append(float(e.get("dur", 0.0)))
    return dict(out)


def device_kernels(trace_path: str) -> tuple[dict[str, list[float]], list[str]]:
    """{kernel name: [durations in microseconds]} over the trace's device streams, and the device process names."""
    events, names = _events(trace_path)
    devices = {pid for pid, n in names.items() if "/device:" in n and "CPU" not in n}
    return _by_name(events, devices), sorted(names[p] for p in devices)


def device_span_us(trace_path: str) -> float:
    """From the first device kernel's start to the last one's end: busy time plus the gaps between kernels."""
    events, names = _events(trace_path)
    devices = {pid for pid, n in names.items() if "/device:" in n and "CPU" not in n}
    spans = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in events
             if e.get("ph") == "X" and e.get("pid") in devices]  # fmt: skip
    return max(b for _, b in spans) - min(a for a, _ in spans) if spans else 0.0


def host_table(trace_path: str, calls: int, top: int = 15) -> str:
    """The host threads' longest events (dispatch, executable launch, thunks) per call."""
    events, names = _events(trace_path)
    host = _by_name(events, {pid for pid, n in names.items() if "/host:" in n})
    rows = sorted(host.items(), key=lambda kv: -sum(kv[1]))[:top]
    body = [[n[:70], f"{len(d) / calls:.1f}", f"{sum(d) / calls:.1f}"] for n, d in rows]
    return format_table(["host event", "per call", "us/call"], body)


def table(trace_path: str, calls: int, top: int = 25) -> tuple[str, dict[str, Any]]:
    kernels, devices = device_kernels(trace_path)
    if not kernels:
        return f"(no device kernels in {trace_path}; processes: {devices or 'none on a device'})", {}
    total = sum(sum(d) for d in kernels.values())
    rows = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))
    body = [
        [name[:70], f"{len(d) / calls:.0f}", f"{sum(d) / calls:.1f}", f"{100 * sum(d) / total:.1f}%"]
        for name, d in rows[:top]
    ]
    summary = dict(
        device_us_per_call=total / calls, kernels_per_call=sum(len(d) for d in kernels.values()) / calls,
        top=[dict(name=n, count=len(d) / calls, us_per_call=sum(d) / calls) for n, d in rows[:top]],
    )  # fmt: skip
    span = device_span_us(trace_path)
    summary["device_span_us_per_call"] = span / calls
    head = (
        f"device time per call {total / calls:.1f} us in {summary['kernels_per_call']:.0f} kernels "
        f"({len(kernels)} distinct; streams of {', '.join(devices)}); first kernel to last, per call: "
        f"{span / calls:.1f} us\n"
    )
    body_text = format_table(["kernel", "per call", "us/call", "share"], body)
    return head + body_text + "\n" + host_table(trace_path, calls), summary
