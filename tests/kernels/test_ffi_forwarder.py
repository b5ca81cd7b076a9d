"""numba_ffi.Forwarder: an FFI target registered before its handler is built. XLA compiles against it without the
handler; a run forwards to the handler once built (by finish_builds, or by the first run, which waits for it); a build
that fails fails the runs with an error naming the target, and is not retried; a process exits with a call queued."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import numba_ffi

_names = itertools.count()


@pytest.fixture(scope="module")
def plus_one():
    """A real handler: result = operand + 1 (f32[n])."""
    from numba import carray, cfunc, types

    h = numba_ffi.jit_helpers()
    answer_non_execute, buffer, data, dim, null = h.answer_non_execute, h.buffer, h.data, h.dim, h.null

    @cfunc(types.voidptr(types.voidptr))
    def handler(frame_ptr):
        frame = carray(frame_ptr, (15,), dtype=np.int64)
        if answer_non_execute(frame):
            return null()
        bx = buffer(frame, 0, False)
        n = dim(bx, 0)
        x = carray(data(bx), (n,), dtype=np.float32)
        out = carray(data(buffer(frame, 0, True)), (n,), dtype=np.float32)
        for i in range(n):
            out[i] = x[i] + 1
        return null()

    return handler


def _register(build):
    """A new target registered ahead of `build`, and a jitted function that calls it (times 2)."""
    name = f"jaxinfer_test_forwarder_{next(_names)}"
    numba_ffi.register(name, build, building=True)
    forwarder = numba_ffi._handlers[name]
    assert isinstance(forwarder, numba_ffi.Forwarder)
    fn = jax.jit(lambda x: jax.ffi.ffi_call(name, jax.ShapeDtypeStruct(x.shape, x.dtype))(x) * 2)
    return name, forwarder, fn


@pytest.mark.parametrize("n", [1, 7, 64])
def test_compiles_without_the_handler_and_runs_it_once_built(plus_one, n):
    builds = []
    name, forwarder, fn = _register(lambda: builds.append(1) or plus_one)
    x = jnp.arange(n, dtype=jnp.float32)
    compiled = fn.lower(x).compile()
    assert builds == [] and numba_ffi.pending()
    numba_ffi.finish_builds()
    assert builds == [1] and forwarder.handler is plus_one and not numba_ffi.pending()
    np.testing.assert_array_equal(np.asarray(compiled(x)), (np.arange(n) + 1) * 2)
    np.testing.assert_array_equal(np.asarray(fn(x + 1)), (np.arange(n) + 2) * 2)
    assert builds == [1]


def test_the_first_run_waits_for_the_build(plus_one):
    """No finish_builds: the run that needs the handler builds it on XLA's thread (it waits on a slow build)."""
    release = threading.Event()
    threading.Timer(0.3, release.set).start()
    _, forwarder, fn = _register(lambda: release.wait(10) and plus_one)
    np.testing.assert_array_equal(np.asarray(fn(jnp.ones(4, jnp.float32))), np.full(4, 4.0))
    assert release.is_set() and forwarder.handler is plus_one


def test_the_first_run_of_several_threads_builds_once(plus_one):
    """Programs queued behind a slow one run on XLA's threads, several at once: one build, every result right."""
    builds = []
    _, forwarder, fn = _register(lambda: builds.append(1) or plus_one)
    slow = jax.jit(lambda a: jnp.linalg.matrix_power(a, 32)[0] * 0)
    a = jnp.eye(512, dtype=jnp.float32)
    results = [None] * 4

    def run(i):
        results[i] = np.asarray(fn(slow(a) + i))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert builds == [1] and forwarder.handler is plus_one
    for i, got in enumerate(results):
        np.testing.assert_array_equal(got, np.full(512, (i + 1) * 2.0))


def test_a_failed_build_fails_the_runs_and_is_not_retried(caplog):
    calls = []

    def broken():
        calls.append(1)
        raise RuntimeError("no compiler here")

    name, forwarder, fn = _register(broken)
    x = jnp.ones(3, jnp.float32)
    for _ in range(3):
        with pytest.raises(Exception, match=f"{name} failed to build"):
            fn(x).block_until_ready()
    logged = [r for r in caplog.records if r.name == "kernels_pallas.numba_ffi"]
    assert calls == [1] and len(logged) == 1 and "no compiler here" in caplog.text
    assert isinstance(numba_ffi.failed(name), RuntimeError) and not forwarder.pending
    numba_ffi.finish_builds()  # an old failure is not raised again: later engines in this process start
    with pytest.raises(numba_ffi.BuildFailed, match="no compiler here"):
        forwarder.resolve()
    assert calls == [1]


def test_finish_builds_raises_a_build_that_fails_in_it():
    def broken():
        raise RuntimeError("out of memory")

    name, _, _ = _register(broken)
    with pytest.raises(numba_ffi.BuildFailed, match="out of memory"):
        numba_ffi.finish_builds()
    assert numba_ffi.failed(name) is not None


# A program queued on XLA's threads behind a slow one, calling a target whose handler is still building, when the
# interpreter exits: without the exit hook the worker called back into a finalizing interpreter and the process hung.
EXIT_WITH_A_QUEUED_CALL = r"""
import sys, time
sys.path.insert(0, sys.argv[1])
import jax, jax.numpy as jnp
from kernels_pallas import numba_ffi

def build():
    time.sleep(30)
    raise RuntimeError("never needed")

numba_ffi.register("jaxinfer_test_forwarder_exit", build, building=True)
slow = jax.jit(lambda a: jnp.linalg.matrix_power(a, 64)[0])
fn = jax.jit(lambda x: jax.ffi.ffi_call("jaxinfer_test_forwarder_exit", jax.ShapeDtypeStruct(x.shape, x.dtype))(x))
z = fn(slow(jnp.eye(1500, dtype=jnp.float32)))
del z
print("exiting", flush=True)
"""


def test_the_process_exits_with_a_call_still_queued(tmp_path):
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"JAX_PLATFORMS": "cpu"}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", EXIT_WITH_A_QUEUED_CALL, str(root)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0 and "exiting" in done.stdout, done.stderr[-2000:]
    assert time.perf_counter() - start < 25, "waited for the build at exit"


def test_where_no_forwarder_can_be_made_registration_waits_for_the_build(plus_one, monkeypatch, caplog):
    def no_llvm(name, build):
        raise RuntimeError("LLVM IR parsing error")

    monkeypatch.setattr(numba_ffi, "Forwarder", no_llvm)
    name = f"jaxinfer_test_forwarder_{next(_names)}"
    numba_ffi.register(name, lambda: plus_one, building=True)
    assert numba_ffi._handlers[name] is plus_one and "cannot register a forwarder" in caplog.text
    fn = jax.jit(lambda x: jax.ffi.ffi_call(name, jax.ShapeDtypeStruct(x.shape, x.dtype))(x))
    np.testing.assert_array_equal(np.asarray(fn(jnp.zeros(2, jnp.float32))), np.ones(2))
