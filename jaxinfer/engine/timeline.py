"""When the device works and when it waits: per-step timestamps, taken without slowing the engine down.

The runner calls `dispatched(...)` after it launched a step (jax returns before the device finishes). A watcher
thread then blocks on that step's outputs and notes when they became ready. Steps run on the device in dispatch
order, so step k occupies the device from max(dispatched_k, ready_{k-1}) to ready_k, and the device sits idle
from ready_{k-1} to dispatched_k when the host was late. Host time is what the engine thread spent preparing
the step: scheduling, packing and launching it.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from dataclasses import dataclass

import jax
import numpy as np


@dataclass
class StepTimes:
    kind: str  # "decode" or "mixed"
    num_seqs: int  # sequences in the step (not the padded bucket)
    num_tokens: int
    host_start: float  # perf_counter when the engine began preparing this step
    dispatched: float  # when the launch returned
    ready: float = 0.0  # when the device had the step's outputs


class StepTimeline:
    def __init__(self, max_steps: int = 100_000):
        """Keeps the last `max_steps` steps (a server keeps a window; a benchmark keeps its whole run)."""
        self.steps: deque[StepTimes] = deque(maxlen=max_steps)
        self._queue: queue.Queue = queue.Queue()
        self._live: dict[str, float] = {"steps": 0}
        self._live_at = 0.0
        self._thread = threading.Thread(target=self._watch, name="jaxinfer-timeline", daemon=True)
        self._thread.start()

    def dispatched(self, host_start: float, kind: str, num_seqs: int, num_tokens: int, outputs) -> None:
        now = time.perf_counter()
        rec = StepTimes(kind, num_seqs, num_tokens, host_start, now)
        self.steps.append(rec)
        self._queue.put((rec, outputs))

    def _watch(self) -> None:
        while True:
            rec, outputs = self._queue.get()
            jax.block_until_ready(outputs)
            rec.ready = time.perf_counter()

    def wait(self) -> None:
        """Blocks until every recorded step has its ready time."""
        while not self._queue.empty() or (self.steps and self.steps[-1].ready == 0.0):
            time.sleep(0.001)

    def clear(self) -> None:
        self.wait()
        self.steps.clear()

    def live_summary(self, every_s: float = 0.5) -> dict[str, float]:
        """summary(wait=False), recomputed at most every `every_s` seconds: cheap enough to call every step."""
        now = time.perf_counter()
        if now - self._live_at >= every_s:
            self._live, self._live_at = self.summary(wait=False), now
        return self._live

    def summary(
        self, kind: str | None = None, skip: int = 0, wait: bool = True, num_seqs: int | None = None
    ) -> dict[str, float]:
        """Means over consecutive steps (optionally only those of one kind and batch size; the first `skip` pairs
        dropped): device busy time per step, host preparation time, the device's idle gap before each step, and
        idle / (idle + busy).
        wait=False (a live server) summarises the steps already done without waiting for the one in flight."""
        if wait:
            self.wait()
        steps = list(self.steps)
        while steps and steps[-1].ready == 0.0:
            steps.pop()
        rows = []
        for prev, cur in zip(steps, steps[1:], strict=False):
            if kind is not None and (cur.kind != kind or prev.kind != kind):
                continue
            if num_seqs is not None and (cur.num_seqs != num_seqs or prev.num_seqs != num_seqs):
                continue
            start = max(cur.dispatched, prev.ready)
            rows.append((cur.ready - start, cur.dispatched - cur.host_start, max(0.0, cur.dispatched - prev.ready)))
        rows = rows[skip:]
        if not rows:
            return {"steps": 0}
        busy, host, idle = (np.asarray(c) for c in zip(*rows, strict=True))
        return {
            "steps": len(rows),
            "device_ms": float(busy.mean() * 1e3),
            "host_ms": float(host.mean() * 1e3),
            "idle_ms": float(idle.mean() * 1e3),
            "idle_share": float(idle.sum() / (idle.sum() + busy.sum())),
            "step_ms": float((busy.sum() + idle.sum()) / len(rows) * 1e3),
        }
