"""The CPU kernel's build in a child process while the weights load (kernels_pallas.ragged_cpu.prebuild): the first
trace registers a forwarder and the steps compile while the child builds, the first run loads what the child built, a
failed or stuck child leaves the build to the process, and nothing starts where there is nothing to build."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import pytest

from kernels_pallas import dispatch, numba_ffi, ragged_cpu

ROOT = Path(__file__).resolve().parents[2]

# Run in a process of its own with an empty numba cache: the state of a machine's first start, with the default
# model's handler on CPU (head dim 64, a float16 pool). It finds the package through its own sys.path, as a notebook
# may, so the child must be told where it is.
FIRST_START = r"""
import sys
sys.path.insert(0, sys.argv[1])
import jax, jax.numpy as jnp, numpy as np
from kernels_pallas import numba_ffi, ragged_cpu, ragged_cpu_numba, reference

assert not ragged_cpu_numba.cached(64, "float16")
assert ragged_cpu.prebuild(64, "float16")
assert not ragged_cpu.prebuild(64, "float16"), "a child is building it: nothing more starts"
assert ragged_cpu.unavailable(64, "float16") is None
forwarder = numba_ffi._handlers[ragged_cpu.target(64, "float16")]
assert isinstance(forwarder, numba_ffi.Forwarder), "the trace waited for the child instead of going on"

rng = np.random.default_rng(0)
q = jnp.asarray(rng.standard_normal((3, 9, 64)), jnp.float32)
k, v = (jnp.asarray(rng.standard_normal((8, 16, 3, 64)), jnp.float16) for _ in range(2))
table = jnp.asarray([[3, 1], [0, 5], [7, 2]], jnp.int32)
lengths = jnp.asarray([5, 20, 32], jnp.int32)
step = jax.jit(lambda *a: ragged_cpu.paged_decode_attention(*a, scale=0.125)).lower(q, k, v, table, lengths).compile()
assert forwarder.handler is None and numba_ffi.pending(), "compiled while the child builds"
got = step(q, k, v, table, lengths)  # the first run waits for the child and loads what it built
assert forwarder.handler._cache_hits == 1, "loaded the child's build instead of building"
assert ragged_cpu_numba.cached(64, "float16") and not ragged_cpu.prebuild(64, "float16") and not numba_ffi.pending()
assert not ragged_cpu_numba.cached(64), "the float32 pool's handler is another, not built"
want = reference.paged_decode_attention(q, k.astype(jnp.float32), v.astype(jnp.float32), table, lengths, scale=0.125)
np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
print("first start ok")
"""


def test_a_first_start_compiles_while_the_child_builds_the_kernel_and_runs_what_it_built(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(NUMBA_CACHE_DIR=str(tmp_path / "numba"), JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", FIRST_START, str(ROOT)], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0 and "first start ok" in done.stdout, done.stderr[-3000:]


@pytest.fixture
def must_build(monkeypatch):
    """This process's kernel is registered and cached (the suite uses it): make prebuild see a new machine, and
    forget any child it starts."""
    monkeypatch.setattr(numba_ffi, "registered", lambda name: False)
    from kernels_pallas import ragged_cpu_numba

    monkeypatch.setattr(ragged_cpu_numba, "cached", lambda head_dim, kv_dtype="float32": False)
    monkeypatch.setattr(ragged_cpu, "_prebuilds", {})


def _child(monkeypatch, code: str) -> None:
    monkeypatch.setattr(ragged_cpu, "_child_command", lambda head_dim, kv_dtype: [sys.executable, "-c", code])


def test_a_failed_child_is_logged_and_leaves_the_build_to_the_first_trace(must_build, monkeypatch, caplog):
    _child(monkeypatch, "import sys; sys.exit('no compiler here')")
    assert ragged_cpu.prebuild(64)
    with caplog.at_level(logging.WARNING, logger="kernels_pallas.ragged_cpu"):
        ragged_cpu._join_prebuild((64, "float32"))
    assert "background build failed (exit 1)" in caplog.text and "no compiler here" in caplog.text
    assert ragged_cpu._prebuilds == {}


def test_a_child_past_its_time_is_stopped(must_build, monkeypatch, caplog):
    _child(monkeypatch, "import time; time.sleep(60)")
    monkeypatch.setattr(ragged_cpu, "PREBUILD_TIMEOUT_S", 0.5)
    assert ragged_cpu.prebuild(64)
    child, _ = ragged_cpu._prebuilds[64, "float32"]
    start = time.perf_counter()
    with caplog.at_level(logging.WARNING, logger="kernels_pallas.ragged_cpu"):
        ragged_cpu._join_prebuild((64, "float32"))
    assert time.perf_counter() - start < 10 and child.returncode is not None
    assert "passed" in caplog.text and "building it here" in caplog.text


def test_where_no_process_can_start_the_first_trace_builds(must_build, monkeypatch, caplog):
    def refuse(*args, **kwargs):
        raise PermissionError("fork refused")

    monkeypatch.setattr(ragged_cpu.subprocess, "Popen", refuse)
    with caplog.at_level(logging.WARNING, logger="kernels_pallas.ragged_cpu"):
        assert not ragged_cpu.prebuild(64)
    assert "could not start" in caplog.text and ragged_cpu._prebuilds == {}


def test_one_child_per_handler(must_build, monkeypatch):
    """Head dims 16 and 128 share the any-head-dim handler: one child builds it; 64 has its own; a float16 pool's
    handlers are others."""
    _child(monkeypatch, "pass")
    assert ragged_cpu.prebuild(16) and not ragged_cpu.prebuild(128) and ragged_cpu.prebuild(64)
    assert ragged_cpu.prebuild(64, "float16") and not ragged_cpu.prebuild(64, jnp.float16)
    assert sorted(ragged_cpu._prebuilds) == [(0, "float32"), (64, "float16"), (64, "float32")]
    for key in list(ragged_cpu._prebuilds):
        ragged_cpu._join_prebuild(key)


def test_nothing_starts_for_a_registered_or_cached_handler(monkeypatch):
    from kernels_pallas import ragged_cpu_numba

    monkeypatch.setattr(ragged_cpu, "_prebuilds", {})
    assert ragged_cpu.unavailable(64) is None  # registered in this process now
    assert not ragged_cpu.prebuild(64)
    monkeypatch.setattr(numba_ffi, "registered", lambda name: False)
    assert ragged_cpu_numba.cached(64)  # the suite's build
    assert not ragged_cpu.prebuild(64) and ragged_cpu._prebuilds == {}


@pytest.mark.parametrize("error", [AttributeError, RuntimeError])
def test_a_cache_index_numba_cannot_open_starts_nothing(monkeypatch, error):
    """numba's internals changed (AttributeError), or it has no folder to cache in (RuntimeError): no child; the
    first trace meets numba's cache as it always did."""
    import numba.core.caching

    from kernels_pallas import ragged_cpu_numba

    def unusable(py_func):
        raise error("no locator available")

    monkeypatch.setattr(numba.core.caching, "FunctionCache", unusable)
    assert ragged_cpu_numba.cached(64)


@pytest.mark.parametrize(
    "impl,dtype,kv_dtype,starts",
    [
        (None, "float32", "float32", True),
        (None, "float32", "float16", True),  # the CPU default (resolve_kv_cache_dtype)
        ("cpu", "float32", "float32", True),
        ("cpu_jnp", "float32", "float32", False),
        ("reference", "float32", "float32", False),
        (None, "float32", "bfloat16", False),
        (None, "bfloat16", "bfloat16", False),
    ],
)
def test_prepare_starts_the_build_only_where_the_kernel_will_run(monkeypatch, impl, dtype, kv_dtype, starts):
    calls = []
    monkeypatch.setattr(dispatch.jax, "default_backend", lambda: "cpu")  # also where the run has a GPU
    monkeypatch.setattr(ragged_cpu, "prebuild", lambda *handler: calls.append(handler) or True)
    assert dispatch.prepare(impl, lambda: (64, jnp.dtype(dtype), kv_dtype)) == starts
    assert calls == ([(64, kv_dtype)] if starts else [])


@pytest.mark.parametrize("impl", [None, "cpu"])
def test_prepare_reads_no_config_on_other_backends(monkeypatch, impl):
    """Only the CPU kernel builds ahead: on a GPU or TPU the model's config is not read for it."""
    monkeypatch.setattr(dispatch.jax, "default_backend", lambda: "gpu")

    def model_shape():
        raise AssertionError("read the config on a GPU")

    assert not dispatch.prepare(impl, model_shape)


@pytest.mark.parametrize("running", [True, False])
def test_a_trace_registers_a_forwarder_only_while_the_child_builds(monkeypatch, running):
    registered = []
    monkeypatch.setattr(numba_ffi, "register", lambda name, build, building=False: registered.append(building))
    monkeypatch.setattr(ragged_cpu, "_building", lambda variant: running)
    assert ragged_cpu.unavailable(64) is None and registered == [running]


def test_a_kernel_whose_build_failed_beside_a_trace_is_unavailable_to_later_traces(monkeypatch):
    """Its programs fail; a later engine in the process takes another kernel instead (the dispatcher's fallback)."""
    monkeypatch.setattr(numba_ffi, "failed", lambda name: RuntimeError("no compiler here"))
    assert ragged_cpu.unavailable(64) == "the numba kernel failed to build (RuntimeError: no compiler here)"
