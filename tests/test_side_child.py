"""Waits for the side child (tests/side_child.py): heavy test files it has been running beside this process since
the session's tests were collected."""

from __future__ import annotations

import pytest

from tests import children, side_child


@pytest.mark.skipif(side_child.CHILD, reason="the parent launcher")
def test_side_child_files_pass():
    if not side_child.handed_over():
        pytest.skip("none of the side child's tests were selected")
    children.check(side_child.NAME, skips=True)
