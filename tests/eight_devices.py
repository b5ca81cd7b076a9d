"""One child pytest on 8 forced CPU devices for every test that needs a mesh.

jax fixes the device count when it starts, so mesh tests cannot run in the main pytest process. Each file that
needs 8 devices marks its tests `child_only` and imports jax-dependent code under `if CHILD:`; one launcher
(tests/test_eight_devices.py) runs all those files in a single child process, which pays jax's start-up and the
shared small-model compiles once instead of once per file. The child starts as soon as the parent has collected
its tests and runs beside them; the launcher test waits for it and fails with its output.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import IO

import pytest

CHILD = os.environ.get("JAXINFER_8DEV_CHILD") == "1"
child_only = pytest.mark.skipif(not CHILD, reason="runs in the 8-device child (tests/test_eight_devices.py)")

# The files whose tests run in the child, relative to the repository root.
FILES = (
    "tests/sharding/test_mesh.py",
    "tests/sharding/test_pool_sizing.py",
    "tests/engine/test_dp_capacity.py",
    # Only this test of that file: the others run in the parent.
    "tests/engine/test_sessions.py::test_dp_front_keeps_sessions_on_their_replica",
)


LAUNCHER = "tests/test_eight_devices.py"


@dataclass
class Child:
    proc: subprocess.Popen
    out: IO[str]  # stdout and stderr together, in a file: a pipe nobody reads until the end would fill and stall it

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


def start_child(files: tuple[str, ...]) -> Child:
    """Starts `files` in a child pytest that sees 8 CPU devices. The parent starts it once its tests are collected
    (tests/conftest.py), so it runs beside the parent's own tests: the parent keeps about 1.2 of the CI machine's 2
    cores busy on average, and the child's ~100 s of mostly compiling fills much of the rest."""
    env = {**os.environ, "JAXINFER_8DEV_CHILD": "1", "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
           "JAX_PLATFORMS": "cpu"}  # fmt: skip
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=5", *files]
    out = tempfile.TemporaryFile("w+", encoding="utf-8")
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
    return Child(proc, out)


_started: list[Child] = []


def start_with_session(items: list[pytest.Item]) -> None:
    """Starts the child when the launcher test is among the collected ones (not in the child itself)."""
    if not CHILD and not _started and any(i.nodeid.startswith(LAUNCHER) for i in items):
        # Both pytests and the servers their tests start load the CPU attention kernel's two handlers (head dim 64, the
        # default model's, and any other, the tiny test model's). They are built here first: numba does not lock its
        # cache, so processes that start before one is written each compile it (~10 s on 2 cores).
        from kernels_pallas import ragged_cpu

        for head_dim in (64, 16):
            ragged_cpu.unavailable(head_dim)
        _started.append(start_child(FILES))


def started_child() -> Child:
    """The child started for this session: tests/conftest.py starts it whenever the launcher is collected."""
    assert _started, "the 8-device child was not started (tests/conftest.py's pytest_collection_finish)"
    return _started[0]


def stop_with_session() -> None:
    while _started:
        _started.pop().stop()
