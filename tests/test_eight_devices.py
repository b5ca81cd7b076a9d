"""Waits for the child pytest that runs the mesh tests (tests/eight_devices.FILES) on 8 CPU devices: started
when the session's tests were collected (tests/conftest.py), it has been running beside the parent's tests."""

from __future__ import annotations

import pytest

from tests.eight_devices import CHILD, started_child


@pytest.mark.skipif(CHILD, reason="the parent launcher")
def test_mesh_suites_on_8_cpu_devices():
    code, out = started_child().wait(timeout=900)
    assert code == 0, out[-11000:]
    assert " passed" in out and " skipped" not in out, out[-3000:]
