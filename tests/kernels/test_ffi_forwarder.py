"""numba_ffi.Forwarder: an FFI target registered before its handler is built. XLA compiles against it without the
handler; a run forwards to the handler once built (by finish_builds, or by the first run, which waits for it); a build
that fails fails the runs with an error naming the target, and is not retried."""

from __future__ import annotations

import itertools
import threading

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


def test_a_failed_build_fails_the_runs_and_is_not_retried(caplog):
    calls = []

    def broken():
        calls.append(1)
        raise RuntimeError("no compiler here")

    name, _, fn = _register(broken)
    try:
        x = jnp.ones(3, jnp.float32)
        for _ in range(2):
            with pytest.raises(Exception, match=f"{name} failed to build"):
                fn(x).block_until_ready()
        assert "no compiler here" in caplog.text
        with pytest.raises(RuntimeError, match="no compiler here"):
            numba_ffi.finish_builds()
        assert calls == [1]
    finally:  # later engines in this process call finish_builds: this target must not fail them
        del numba_ffi._handlers[name]
