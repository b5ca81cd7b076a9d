"""Launches the mesh tests (tests/eight_devices.FILES) in one child pytest with 8 CPU devices."""

from __future__ import annotations

import pytest

from tests.eight_devices import CHILD, FILES, run_child


@pytest.mark.skipif(CHILD, reason="the parent launcher")
def test_mesh_suites_on_8_cpu_devices():
    r = run_child(FILES, timeout=900)
    assert r.returncode == 0, r.stdout[-8000:] + r.stderr[-3000:]
    assert " passed" in r.stdout and " skipped" not in r.stdout, r.stdout[-3000:]
