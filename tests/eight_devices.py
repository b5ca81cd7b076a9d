"""One child pytest on 8 forced CPU devices for every test that needs a mesh, run beside the main pytest.

jax fixes the device count when it starts, so mesh tests cannot run in the main pytest process. Each file that
needs 8 devices marks its tests `child_only` and imports jax-dependent code under `if CHILD:`; one launcher
(tests/test_eight_devices.py) runs all those files in a single child process, which pays jax's start-up and the
shared small-model compiles once instead of once per file.

The child starts as soon as the main pytest has collected its tests and runs beside them; the launcher test waits
for it and fails with its output. The main pytest keeps about 1.2 of the CI machine's 2 cores busy on average
(117-141% CPU over whole runs), so the child also takes the CPU suite's kernel tests (SIDE): numeric comparisons
with no timing in them, minutes of interpret-mode Pallas and small compiles, which run the same on 8 host devices.
They stay in the main process when it runs on a GPU or TPU (JAXINFER_TEST_DEVICE=1: the child is CPU-only) or when
the launcher is not selected.
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

# The files whose tests need the child, relative to the repository root.
FILES = (
    "tests/sharding/test_mesh.py",
    "tests/sharding/test_pool_sizing.py",
    "tests/engine/test_dp_capacity.py",
    # Only this test of that file: the others run in the parent.
    "tests/engine/test_sessions.py::test_dp_front_keeps_sessions_on_their_replica",
)
# Tests the child takes from the main pytest (see above), by node id prefix.
SIDE = ("tests/kernels/",)
LAUNCHER = "tests/test_eight_devices.py"


@dataclass
class Child:
    proc: subprocess.Popen
    out: IO[str]  # stdout and stderr together, in a file: a pipe nobody reads until the end would fill and stall it
    output: str | None = None  # once waited for

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
        self.output = self.out.read() + note
        return code, self.output

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if not self.out.closed:
            self.out.close()


def start_child(args: tuple[str, ...]) -> Child:
    """Starts a child pytest that sees 8 CPU devices on `args` (files or node ids)."""
    env = {**os.environ, "JAXINFER_8DEV_CHILD": "1", "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
           "JAX_PLATFORMS": "cpu"}  # fmt: skip
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=5", *args]
    out = tempfile.TemporaryFile("w+", encoding="utf-8")
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
    return Child(proc, out)


_started: list[Child] = []
_side: list[str] = []  # node ids of the side tests the child took


def take_side_tests(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In the main pytest, once its selection is final: moves the side tests to the child when the launcher is
    selected and the suite runs on CPU (they are reported as deselected here and run in the child), then starts it."""
    if CHILD or _started or not any(i.nodeid.startswith(LAUNCHER) for i in items):
        return
    if os.environ.get("JAXINFER_TEST_DEVICE") != "1":
        side = [i for i in items if i.nodeid.startswith(SIDE)]
        if side:
            items[:] = [i for i in items if not i.nodeid.startswith(SIDE)]
            config.hook.pytest_deselected(items=side)
            _side.extend(i.nodeid for i in side)
    _started.append(start_child((*FILES, *_side)))


def started_child() -> Child:
    """The child started for this session (or one started now, when the launcher runs on its own)."""
    if not _started:
        _started.append(start_child(FILES))
    return _started[0]


def side_tests() -> list[str]:
    return list(_side)


def child_report() -> str | None:
    """The waited-for child's slowest tests and summary line, for the main pytest's terminal summary."""
    out = _started[0].output if _started else None
    if not out:
        return None
    start = out.rfind("= slowest")
    return out[out.rfind("\n", 0, start) + 1 :].strip() if start >= 0 else out.strip().splitlines()[-1]


def stop_with_session() -> None:
    for child in _started:  # kept: the terminal summary, which comes later, reads its output
        child.stop()
