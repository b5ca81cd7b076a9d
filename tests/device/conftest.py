"""tests/device/ runs only on a GPU or TPU, with JAXINFER_TEST_DEVICE=1 (see tests/conftest.py and README.md)."""

import os

import jax
import pytest

REASON = (
    "on-device tests: run `JAXINFER_TEST_DEVICE=1 python -m pytest -q tests/device` on a GPU or TPU machine "
    "with jaxinfer[cuda] or jaxinfer[tpu] installed"
)


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(__file__)
    if os.environ.get("JAXINFER_TEST_DEVICE") != "1":
        reason = f"{REASON} (JAXINFER_TEST_DEVICE is not set: the suite is pinned to the CPU)"
    elif jax.default_backend() not in ("gpu", "tpu"):
        reason = f"{REASON} (JAXINFER_TEST_DEVICE=1, but jax's backend here is {jax.default_backend()})"
    else:
        return
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.skip(reason=reason))
