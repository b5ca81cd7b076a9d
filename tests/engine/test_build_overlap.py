"""build_engine starts the attention kernel's build for the model's head dim, and the projection kernel's load, before
it loads the weights."""

from __future__ import annotations

import pytest

import jaxinfer.engine.build as build
from jaxinfer.engine.config import EngineArgs
from kernels_pallas import project_cpu
from tests.tiny_model import write_tiny_model


class _Stop(Exception):
    pass


@pytest.mark.parametrize("kwargs,expected,projection", [
    ({}, (None, 16, "float32", "float16"), True),  # a float32 model's pool on CPU: float16 (resolve_kv_cache_dtype)
    ({"attn_impl": "cpu_jnp", "kv_cache_dtype": "bfloat16"}, ("cpu_jnp", 16, "float32", "bfloat16"), True),
    ({"dtype": "bfloat16"}, (None, 16, "bfloat16", "float32"), False),  # the projection kernel is float32's only
])  # fmt: skip
def test_the_kernels_are_prepared_for_the_models_shape_before_the_weights_load(tmp_path, monkeypatch, kwargs,
                                                                                expected, projection):  # fmt: skip
    write_tiny_model(tmp_path / "tiny")  # head dim 16
    events = []
    monkeypatch.setattr(build.kernels_pallas, "prepare",
                        lambda impl, shape: events.append(("prepare", (impl, *shape()))) or False)  # fmt: skip
    monkeypatch.setattr(project_cpu, "prepare", lambda: events.append(("projection kernel", None)))

    def load(*args):
        events.append(("load", None))
        raise _Stop

    monkeypatch.setattr(build, "_load", load)
    with pytest.raises(_Stop):  # a pathlib.Path, as a user passes one: the weights' path, not a module of theirs
        build.build_engine(EngineArgs(model=tmp_path / "tiny", **kwargs))
    assert events == [("prepare", expected), *[("projection kernel", None)] * projection, ("load", None)]


def test_warmup_loads_the_kernels_built_beside_its_compiles(tmp_path, monkeypatch):
    """A kernel a trace registered ahead of its build (kernels_pallas.finish_builds) is loaded by the warm-up, after
    the compiles: a build that failed fails the start, not the first request."""
    write_tiny_model(tmp_path / "tiny")
    engine, _ = build.build_engine(EngineArgs(model=str(tmp_path / "tiny"), max_num_seqs=1, max_num_batched_tokens=16,
                                              max_model_len=64))  # fmt: skip

    def failed_build():
        raise RuntimeError("the kernel's build failed")

    monkeypatch.setattr(build.kernels_pallas, "finish_builds", failed_build)
    with pytest.raises(RuntimeError, match="the kernel's build failed"):
        engine.runner.warmup(advanced=False)
