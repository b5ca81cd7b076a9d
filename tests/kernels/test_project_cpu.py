"""The batch-invariant CPU projection kernel (kernels_pallas/project_cpu.py, called through XLA's FFI) against the
product it must match bit for bit: XLA:CPU's library dot, x @ W^T over 128 rows, which sums every output in the same
order for any row count from 2 up (the order the kernel is written to). And against numpy's float64 product, to the
rounding of float32."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import project_cpu

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="a CPU kernel")

_CONTRACT = (((1,), (1,)), ((), ()))
_library_dot = jax.jit(lambda x, w: jax.lax.dot_general(x, w, _CONTRACT))
_kernel = jax.jit(project_cpu.project_rows)


def _case(n: int, k: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed + n + k)
    return rng.standard_normal((128, k), dtype=np.float32), rng.standard_normal((n, k), dtype=np.float32)


# SmolLM2's projections (q, k and v, o, gate and up fused, down, the LM head), a kernel whose inputs span two of the
# library's blocks of 2048 and end inside a third, one output block of 16 and a few.
@pytest.mark.parametrize("n,k", [(576, 576), (192, 576), (3072, 576), (576, 1536), (49152, 576), (64, 4100),
                                 (16, 40), (48, 2048)])  # fmt: skip
# Rows past the widest vector's lanes (8 on AVX2, 32 on AVX-512) go in chunks of it, the rest in a narrower one.
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9, 16, 23, 32, 40, 64, 100, 128])
def test_the_kernel_sums_as_the_library_dot(n, k, rows):
    if project_cpu.library_k_block(n) is None:
        pytest.skip(f"this machine's library sums {n} outputs in an order the kernel lacks: not used (library_k_block)")
    x, w = _case(n, k)
    want = np.asarray(_library_dot(jnp.asarray(x), jnp.asarray(w)))[:rows]
    got = np.asarray(_kernel(jnp.asarray(x[:rows]), jnp.asarray(w)))
    assert got.shape == (rows, n)
    np.testing.assert_array_equal(got, want)
    exact = x[:rows].astype(np.float64) @ w.T.astype(np.float64)
    np.testing.assert_allclose(got, exact, rtol=1e-4, atol=1e-3 * np.sqrt(k))


@pytest.mark.parametrize("wide", [True, False])
def test_the_order_probe_tells_the_truth(wide):
    """library_k_block's verdict is the first block of inputs with which the kernel gives the library dot's bits at
    the probe's shapes, computed here on other data (None: none does, so `project` takes the library's dot)."""
    kernel = jax.jit(project_cpu.project_rows, static_argnames="k_block")
    matching = []
    for k_block in project_cpu.K_BLOCKS:
        same = []
        for n, k in project_cpu.PROBE_SHAPES[wide]:
            x, w = (jnp.asarray(a) for a in _case(n, k, seed=11))
            want = np.asarray(_library_dot(x, w))
            rows = sorted({1, 5, project_cpu.max_rows()})
            same += [np.array_equal(np.asarray(kernel(x[:r], w, k_block=k_block)), want[:r]) for r in rows]
        if all(same):
            matching.append(k_block)
    n = project_cpu.PROBE_SHAPES[wide][0][0]
    assert project_cpu.library_k_block(n) == (matching[0] if matching else None)


@pytest.mark.parametrize("n", [1, 5, 13, 21, 35])
@pytest.mark.parametrize("rows", [1, 3, 20, 45])
def test_outputs_past_the_last_whole_block(n, rows):
    """Outputs past the last whole block of 8 or 16 take the same code through a zero-padded copy of their rows:
    the same bits as when the kernel is padded with zero rows by the caller."""
    x, w = _case(n, 300)
    padded = np.concatenate([w, np.zeros((48 - n, 300), np.float32)])
    got = np.asarray(_kernel(jnp.asarray(x[:rows]), jnp.asarray(w)))
    want = np.asarray(_kernel(jnp.asarray(x[:rows]), jnp.asarray(padded)))[:, :n]
    np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(got, x[:rows].astype(np.float64) @ w.T.astype(np.float64), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("rows", [1, 4, 20, 72])
def test_a_stacked_kernel_is_read_at_its_layer(rows):
    x, w = _case(96, 64)
    stack = np.stack([w * (i + 1) for i in range(3)])
    fn = jax.jit(project_cpu.project_rows)
    for layer in range(3):
        got = np.asarray(fn(jnp.asarray(x[:rows]), jnp.asarray(stack), jnp.int32(layer)))
        np.testing.assert_array_equal(got, np.asarray(_kernel(jnp.asarray(x[:rows]), jnp.asarray(stack[layer]))))


def test_supported_cases():
    x, w = jnp.zeros((3, 32), jnp.float32), jnp.zeros((64, 32), jnp.float32)
    usable = project_cpu.library_k_block(64) is not None  # used only where it sums as the library dot does
    assert project_cpu.supported(x, w) == usable and project_cpu.supported(x[:1], w[None]) == usable
    assert project_cpu.supported(jnp.zeros((200, 32), jnp.float32), w) == usable  # in chunks of rows
    assert not project_cpu.supported(x[:0], w)
    assert not project_cpu.supported(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16))
    assert not project_cpu.supported(x, jnp.zeros((64, 31), jnp.float32))


# rows -> (lanes, padded rows) where the kernel's widest vector holds 32 rows (AVX-512) and where it holds 8 (AVX2).
_LAYOUTS = {32: {2: (8, 8), 9: (16, 16), 17: (32, 32), 32: (32, 32), 33: (32, 40), 50: (32, 64), 100: (32, 104),
                 128: (32, 128), 130: (32, 136)},
            8: {2: (8, 8), 8: (8, 8), 9: (8, 16), 17: (8, 24), 100: (8, 104), 130: (8, 136)}}  # fmt: skip


def test_row_layout_chunks_the_rows():
    """Whole chunks of the widest lanes the CPU's kernel has (or of the narrowest that holds every row), then the
    rest in the narrowest that holds it."""
    for rows, want in _LAYOUTS[project_cpu.max_rows()].items():
        assert project_cpu.row_layout(rows) == want, rows


def test_a_caller_waits_for_the_load_prepare_started_and_nothing_loads_twice(monkeypatch):
    """`prepare` starts the kernel's load (on a new machine its ~11 s build) on a thread while the weights load; the
    runner's own call meanwhile waits for that load instead of starting a second one, and gets its answer."""
    import threading

    from kernels_pallas import numba_ffi

    started, release, loads = threading.Event(), threading.Event(), []

    def slow_failure(module):
        loads.append(module)
        started.set()
        release.wait(10)
        return "a stand-in for numba's answer"

    monkeypatch.setattr(numba_ffi, "load_failure", slow_failure)
    project_cpu._unavailable.cache_clear()
    try:
        project_cpu.prepare()
        assert started.wait(10)
        answers = []
        caller = threading.Thread(target=lambda: answers.append(project_cpu.unavailable()))
        caller.start()
        caller.join(0.2)
        assert caller.is_alive()  # waiting on the load in progress
        release.set()
        caller.join(10)
        assert answers == ["a stand-in for numba's answer"] and len(loads) == 1
    finally:
        release.set()
        monkeypatch.undo()
        project_cpu._unavailable.cache_clear()  # the real answer again for the tests after this one
    assert project_cpu.unavailable() is None
