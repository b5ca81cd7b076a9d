"""Where a compiled step's time goes: records a jax profiler trace of a few calls and tables the device's kernels
and the host's events by total time (from the trace-viewer JSON, `*.trace.json.gz`, the profiler writes beside its
XPlane file).

Used by `bench_latency --trace DIR`. On CPU the trace holds no device stream: XLA's thunks run on host threads, so
the host table is the per-op breakdown."""

from __future__ import annotations

import collections
import dataclasses
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


@dataclasses.dataclass(frozen=True)
class Trace:
    """A profiler trace's complete events, read once, with its device and host processes."""

    events: list[dict]
    names: dict[int, str]  # process id -> name ("/device:GPU:0", "/host:CPU", ...)

    @classmethod
    def load(cls, trace_path: str) -> Trace:
        with gzip.open(trace_path, "rt") as f:
            events = json.load(f)
        events = events["traceEvents"] if isinstance(events, dict) else events
        meta = [e for e in events if e.get("ph") == "M" and e.get("name") == "process_name"]
        return cls(events, {e["pid"]: e.get("args", {}).get("name", "") for e in meta})

    @property
    def device_pids(self) -> set[int]:
        return {pid for pid, n in self.names.items() if "/device:" in n and "CPU" not in n}

    @property
    def host_pids(self) -> set[int]:
        return {pid for pid, n in self.names.items() if "/host:" in n}

    def complete(self, pids: set[int]) -> list[dict]:
        return [e for e in self.events if e.get("ph") == "X" and e.get("pid") in pids]

    def by_name(self, pids: set[int]) -> dict[str, list[float]]:
        """{event name: [durations in microseconds]} over these processes."""
        out: dict[str, list[float]] = collections.defaultdict(list)
        for e in self.complete(pids):
            out[e["name"]].append(float(e.get("dur", 0.0)))
        return dict(out)

    def device_span_us(self) -> float:
        """From the first device kernel's start to the last one's end: busy time plus the gaps between kernels."""
        spans = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in self.complete(self.device_pids)]
        return max(b for _, b in spans) - min(a for a, _ in spans) if spans else 0.0


def host_table(trace: Trace, calls: int, top: int = 15) -> str:
    """The host threads' longest events (dispatch, executable launch; on CPU, XLA's thunks: the ops) per call."""
    rows = sorted(trace.by_name(trace.host_pids).items(), key=lambda kv: -sum(kv[1]))[:top]
    body = [[n[:70], f"{len(d) / calls:.1f}", f"{sum(d) / calls:.1f}"] for n, d in rows]
    return format_table(["host event", "per call", "us/call"], body)


def table(trace_path: str, calls: int, top: int = 25) -> tuple[str, dict[str, Any]]:
    trace = Trace.load(trace_path)
    kernels = trace.by_name(trace.device_pids)
    if not kernels:
        return f"(no device kernels in {trace_path}; on CPU the ops are host events)\n{host_table(trace, calls)}", {}
    devices = sorted(trace.names[p] for p in trace.device_pids)
    total = sum(sum(d) for d in kernels.values())
    rows = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))
    body = [
        [name[:70], f"{len(d) / calls:.0f}", f"{sum(d) / calls:.1f}", f"{100 * sum(d) / total:.1f}%"]
        for name, d in rows[:top]
    ]
    span = trace.device_span_us()
    summary = dict(
        device_us_per_call=total / calls, kernels_per_call=sum(len(d) for d in kernels.values()) / calls,
        device_span_us_per_call=span / calls,
        top=[dict(name=n, count=len(d) / calls, us_per_call=sum(d) / calls) for n, d in rows[:top]],
    )  # fmt: skip
    head = (
        f"device time per call {total / calls:.1f} us in {summary['kernels_per_call']:.0f} kernels "
        f"({len(kernels)} distinct; streams of {', '.join(devices)}); first kernel to last, per call: "
        f"{span / calls:.1f} us\n"
    )
    body_text = format_table(["kernel", "per call", "us/call", "share"], body)
    return head + body_text + "\n" + host_table(trace, calls), summary
