"""Child pytests that run part of the suite beside the main one, each waited for by a launcher test.

A full run keeps about 1.2-1.35 of the CI machine's 2 cores busy on average: much of it is single-threaded (compiling,
numba builds, transformers' GGUF parsing, processes starting). Two children fill the rest:
- the mesh child (tests/eight_devices.py): the files that need 8 forced CPU devices, which jax fixes at start-up;
- the side child (tests/side_child.py): heavy, self-contained files taken out of the main process.

Both start once the main process has collected its tests (tests/conftest.py) and only when their launcher test is
among the collected ones, so running one file alone runs it in-process as usual.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import IO

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Child:
    proc: subprocess.Popen
    out: IO[str]  # stdout and stderr together, in a file: a pipe nobody reads until the end would fill and stall it
    temp: str | None = None  # a file written for the child, removed with it

    def wait(self, timeout: float) -> tuple[int, str]:
        """The child's exit status and output; kills it if it runs past `timeout` seconds from now."""
        note = ""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
            note = f"\n[killed: still running {timeout:.0f} s after the launcher began waiting]"
        self.out.seek(0)
        return code, self.out.read() + note

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.out.close()
        if self.temp:
            os.unlink(self.temp)


_started: dict[str, Child] = {}


def collected(items: list, launcher: str) -> bool:
    """Whether the launcher test file `launcher` is among the collected `items`: its child is wanted."""
    return any(i.nodeid.startswith(launcher) for i in items)


def start(name: str, args: list[str], env: dict[str, str], temp: str | None = None) -> None:
    """Starts the child `name`: pytest over `args`, with `env` added to this process's environment. `temp`: a file
    to remove when the child is stopped."""
    if not _started:
        _build_kernels()
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=5", *args]
    out = tempfile.TemporaryFile("w+", encoding="utf-8")
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT, text=True)
    _started[name] = Child(proc, out, temp)


def started(name: str) -> Child:
    assert name in _started, f"the {name} child was not started (tests/conftest.py's pytest_collection_finish)"
    return _started[name]


def has_started(name: str) -> bool:
    return name in _started


def stop_all() -> None:
    while _started:
        _started.popitem()[1].stop()


def check(name: str, *, skips: bool, timeout: float = 900) -> None:
    """The launcher's assertion: the child `name` ran tests, and all passed (`skips`: or some skipped, as they may
    in the main process; the mesh child's tests skip only outside it)."""
    code, out = started(name).wait(timeout)
    assert code == 0, out[-11000:]
    assert " passed" in out and (skips or " skipped" not in out), out[-3000:]


def _build_kernels() -> None:
    """Builds the CPU attention kernel's two float32 handlers (head dim 64, the default model's, and any other, the
    tiny test model's) and the projection kernel's handler before the first child starts. Every process loads them,
    the servers that tests start too; numba does not lock its cache, so processes that start before one is written
    each compile it (~10 s on 2 cores)."""
    from kernels_pallas import project_cpu, ragged_cpu

    for head_dim in (64, 16):
        ragged_cpu.unavailable(head_dim)
    project_cpu.unavailable()
