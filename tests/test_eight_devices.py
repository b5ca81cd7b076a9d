"""Waits for the child pytest that runs the mesh tests (tests/eight_devices.FILES) on 8 CPU devices: started
when the session's tests were collected (tests/conftest.py), it has been running beside the parent's tests."""

from __future__ import annotations

import pytest

from tests import children, eight_devices


@pytest.mark.skipif(eight_devices.CHILD, reason="the parent launcher")
def test_mesh_suites_on_8_cpu_devices():
    children.check(eight_devices.NAME, skips=False)
