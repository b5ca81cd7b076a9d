"""One child pytest on 8 forced CPU devices for every test that needs a mesh.

jax fixes the device count when it starts, so mesh tests cannot run in the main pytest process. Each file that
needs 8 devices marks its tests `child_only` and imports jax-dependent code under `if CHILD:`; one launcher
(tests/test_eight_devices.py) runs all those files in a single child process, which pays jax's start-up and the
shared small-model compiles once instead of once per file. The child starts as soon as the parent has collected
its tests and runs beside them (tests/children.py); the launcher test waits for it and fails with its output.
"""

from __future__ import annotations

import os

import pytest

from tests import children

NAME = "8-device"
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


def start_with_session(items: list[pytest.Item]) -> None:
    """Starts the child when the launcher test is among the collected ones (not in the child itself)."""
    if not CHILD and not children.has_started(NAME) and children.collected(items, LAUNCHER):
        env = {"JAXINFER_8DEV_CHILD": "1", "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
               "JAX_PLATFORMS": "cpu"}  # fmt: skip
        children.start(NAME, list(FILES), env)
