"""build_engine starts the attention kernel's build for the model's head dim before it loads the weights."""

from __future__ import annotations

import pytest

import jaxinfer.engine.build as build
from jaxinfer.engine.config import EngineArgs
from tests.tiny_model import write_tiny_model


class _Stop(Exception):
    pass


@pytest.mark.parametrize("kwargs,expected", [
    ({}, (None, 16, "float32", "float32")),
    ({"attn_impl": "cpu_jnp", "kv_cache_dtype": "bfloat16"}, ("cpu_jnp", 16, "float32", "bfloat16")),
])  # fmt: skip
def test_the_kernel_is_prepared_for_the_models_head_dim_before_the_weights_load(tmp_path, monkeypatch, kwargs,
                                                                                  expected):  # fmt: skip
    write_tiny_model(tmp_path / "tiny")  # head dim 16
    events = []
    monkeypatch.setattr(build.kernels_pallas, "prepare",
                        lambda impl, shape: events.append(("prepare", (impl, *shape()))) or False)  # fmt: skip

    def load(*args):
        events.append(("load", None))
        raise _Stop

    monkeypatch.setattr(build, "_load", load)
    with pytest.raises(_Stop):
        build.build_engine(EngineArgs(model=str(tmp_path / "tiny"), **kwargs))
    assert events == [("prepare", expected), ("load", None)]
