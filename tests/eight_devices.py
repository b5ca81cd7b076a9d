"""One child pytest on 8 forced CPU devices for every test that needs a mesh.

jax fixes the device count when it starts, so mesh tests cannot run in the main pytest process. Each file that
needs 8 devices marks its tests `child_only` and imports jax-dependent code under `if CHILD:`; one launcher
(tests/test_eight_devices.py) runs all those files in a single child process, which pays jax's start-up and the
shared small-model compiles once instead of once per file.
"""

from __future__ import annotations

import os
import subprocess
import sys

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


def run_child(files: tuple[str, ...], timeout: float) -> subprocess.CompletedProcess:
    """Run `files` in a child pytest that sees 8 CPU devices; returns the finished process."""
    env = {**os.environ, "JAXINFER_8DEV_CHILD": "1", "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
           "JAX_PLATFORMS": "cpu"}  # fmt: skip
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=5", *files]
    return subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
