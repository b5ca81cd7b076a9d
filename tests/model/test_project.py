"""`project`: an output-major kernel f[*out, *in] applied to f[..., *in], whichever dot form the backend and the
row count pick, equals numpy's einsum over the same weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.model import layers
from jaxinfer.model.layers import (
    WEIGHT_LEFT_MAX_OUT_BYTES,
    WEIGHT_LEFT_MAX_ROWS,
    StackedSelect,
    project,
    weight_left_sums_as_library,
)
from kernels_pallas import project_cpu


def _weight_left(rows: int, out: int) -> bool:
    """The CPU form the docstring promises: W @ x^T for 2..WEIGHT_LEFT_MAX_ROWS rows with a small result, where it
    sums as x @ W^T does."""
    return (
        jax.default_backend() == "cpu"
        and 2 <= rows <= WEIGHT_LEFT_MAX_ROWS
        and rows * out * 4 <= WEIGHT_LEFT_MAX_OUT_BYTES
        and weight_left_sums_as_library()
    )


@pytest.mark.parametrize("in_branch", [False, True])
@pytest.mark.parametrize("lead", [(1, 1), (1, 3), (4, 16), (2, 64), (1, 200)])
@pytest.mark.parametrize(
    "out_shape,in_shape",
    [((48,), (32,)), ((3, 16), (32,)), ((32,), (3, 16)), ((9000,), (16,))],  # MLP, q/k/v, heads in, a vocabulary
)
def test_project_matches_einsum(lead, out_shape, in_shape, in_branch):
    rng = np.random.default_rng(sum(lead) + len(out_shape))
    x = rng.standard_normal((*lead, *in_shape)).astype(np.float32)
    w = rng.standard_normal((*out_shape, *in_shape)).astype(np.float32)
    n_out, n_in = len(out_shape), len(in_shape)
    letters_out, letters_in = "pqr"[:n_out], "ijk"[:n_in]
    want = np.einsum(f"ab{letters_in},{letters_out}{letters_in}->ab{letters_out}", x, w)
    fn = jax.jit(lambda x, w: project(x, w, n_in, in_branch=in_branch))
    got = fn(jnp.asarray(x), jnp.asarray(w))
    assert got.shape == want.shape
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-4)


def _form(text: str) -> str:
    """Which dot form a lowered `project` took, from its StableHLO."""
    if "jaxinfer_project" in text:
        return "kernel"  # kernels_pallas.project_cpu's custom call
    if "optimization_barrier" in text:
        return "weight_left"  # W @ x^T, its result transposed behind the barrier
    if "stablehlo.transpose" in text:
        return "vector_times_wt"  # one row: x times W's transpose, the dot XLA:CPU fuses
    dot = next(ln for ln in text.splitlines() if "stablehlo.dot_general" in ln)
    return "gemv" if "contracting_dims = [1] x [0]" in dot else "x_wt"


@pytest.mark.parametrize(
    "rows,out,in_shape,in_branch",
    [(1, 48, (32,), False), (1, 48, (32,), True), (1, 48, (2, 16), False), (8, 48, (32,), False),
     (1, 40, (32,), False), (1, 40, (32,), True), (1, 40, (2, 16), False), (8, 40, (32,), False),
     (9, 48, (32,), False), (128, 48, (32,), False), (129, 48, (32,), False), (64, 40000, (32,), False),
     (16, 64, (32,), False), (32, 64, (32,), False), (33, 64, (32,), False), (64, 64, (2, 16), False),
     (128, 64, (32,), False), (129, 64, (32,), False), (40, 53248, (32,), False), (48, 53248, (32,), False)],
)  # fmt: skip
def test_project_picks_the_measured_form(rows, out, in_shape, in_branch):
    """The form the docstring promises for each case (benchmarks/README.md has the measurements): on CPU, the
    kernel for 1-8 float32 rows (1-32 on AVX-512, and there up to 128 in chunks of 32, given a small result) and an
    output count that is a multiple of 16 where it sums as the library does, else the library's x @ W^T for those;
    the older one-row forms otherwise."""
    x, w = jnp.ones((rows, *in_shape), jnp.float32), jnp.ones((out, *in_shape), jnp.float32)
    text = jax.jit(lambda x, w: project(x, w, len(in_shape), in_branch=in_branch)).lower(x, w).as_text()
    wide = project_cpu.max_rows() if jax.default_backend() == "cpu" else 0
    chunks = wide == 32 and rows <= 128 and rows * out * 4 <= WEIGHT_LEFT_MAX_OUT_BYTES
    if jax.default_backend() != "cpu":
        want = "x_wt"
    elif out % 16 == 0 and project_cpu.library_k_block(out) is not None and (rows <= wide or chunks):
        want = "kernel"
    elif rows <= wide and out % 16 == 0:
        want = "x_wt"
    elif rows == 1:
        want = "vector_times_wt" if not in_branch and len(in_shape) == 1 else "gemv"
    else:
        want = "weight_left" if _weight_left(rows, out) else "x_wt"
    assert _form(text) == want


# A multiple of 16 outputs (what the batch-invariant forms need), two of the library's blocks of 2048 inputs (of 64
# outputs too: the AVX-512 library's blocks of 512 inputs take those), and a kernel with its heads as input axes
# (the output projection).
@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's forms")
@pytest.mark.parametrize("out_shape,in_shape", [((96,), (64,)), ((32,), (4100,)), ((64,), (4100,)), ((48,), (4, 16))])
@pytest.mark.parametrize("stacked", [False, True])
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it(out_shape, in_shape, stacked):
    """Batch invariance: every row's result is bit-identical whatever the row count of the product, from one row
    (the kernel) through the weight-left form's 9-128 (the odd ones padded to a multiple of 16), or the kernel's
    chunks of 32 rows on AVX-512, to x @ W^T."""
    rng = np.random.default_rng(len(in_shape) + out_shape[0])
    x = jnp.asarray(rng.standard_normal((200, *in_shape), dtype=np.float32))
    w = jnp.asarray(rng.standard_normal((3, *out_shape, *in_shape), dtype=np.float32))
    n_in = len(in_shape)
    if stacked:
        fn = jax.jit(lambda x, w: project(x, StackedSelect(w, jnp.int32(1)), n_in))
    else:
        fn = jax.jit(lambda x, w: project(x, w[1], n_in))
    alone = np.concatenate([np.asarray(fn(x[i : i + 1], w)) for i in range(x.shape[0])])
    for rows in (2, 7, 8, 9, 16, 24, 33, 40, 64, 65, 128, 129, 200):
        np.testing.assert_array_equal(np.asarray(fn(x[:rows], w)), alone[:rows], err_msg=f"{rows} rows")


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's forms")
@pytest.mark.parametrize("out_shape,in_shape", [((64,), (4100,)), ((192,), (576,))])
def test_narrow_chunks_keep_the_kernel_and_every_rows_bits(monkeypatch, out_shape, in_shape):
    """Where the kernel takes 8 rows (AVX2; forced here with PROJECTION_KERNEL_ROWS) and NARROW_CHUNK_ROWS lets it
    take more: 9-128 rows go through the kernel, and every row's bits are its bits alone, past 128 rows too."""
    if project_cpu.library_k_block(out_shape[0]) is None:
        pytest.skip("this machine's library sums these outputs in an order the kernel lacks")
    monkeypatch.setattr(layers, "PROJECTION_KERNEL_ROWS", 8)
    monkeypatch.setattr(layers, "NARROW_CHUNK_ROWS", 128)
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((140, *in_shape), dtype=np.float32))
    w = jnp.asarray(rng.standard_normal((*out_shape, *in_shape), dtype=np.float32))
    fn = jax.jit(lambda x, w: project(x, w, 1))
    assert _form(fn.lower(x[:64], w).as_text()) == "kernel"
    alone = np.concatenate([np.asarray(fn(x[i : i + 1], w)) for i in range(x.shape[0])])
    for rows in (9, 16, 33, 64, 100, 128, 129, 140):
        np.testing.assert_array_equal(np.asarray(fn(x[:rows], w)), alone[:rows], err_msg=f"{rows} rows")
