"""Waits for the child pytest on 8 CPU devices (tests/eight_devices.py): the mesh tests, and in a CPU run of the
whole suite the kernel tests too. Started when the session's tests were collected (tests/conftest.py), it has been
running beside the main pytest's tests."""

from __future__ import annotations

import re

import pytest

from tests.eight_devices import CHILD, FILES, side_tests, started_child


@pytest.mark.skipif(CHILD, reason="the parent launcher")
def test_mesh_suites_on_8_cpu_devices():
    code, out = started_child().wait(timeout=1200)
    assert code == 0, out[-11000:]
    assert " passed" in out, out[-3000:]
    # Every mesh test ran: none skipped (a skip there means the child lost its 8 devices or its flag).
    mesh_files = tuple(f.split("::")[0] for f in FILES)
    skipped = [line for line in out.splitlines() if line.startswith("SKIPPED") and any(f in line for f in mesh_files)]
    assert not skipped, "\n".join(skipped)
    side = side_tests()
    if side:  # the side tests the main pytest handed over all ran there (passed or skipped with a reason)
        m = re.search(r"(\d+) passed(?:, (\d+) skipped)?", out.splitlines()[-1])
        assert m, out[-3000:]
        assert int(m.group(1)) + int(m.group(2) or 0) >= len(side), out[-3000:]
