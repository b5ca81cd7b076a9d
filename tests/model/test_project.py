"""`project`: an output-major kernel f[*out, *in] applied to f[..., *in], whichever dot form the backend and the
row count pick, equals numpy's einsum over the same weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.model.layers import WEIGHT_LEFT_MAX_OUT_BYTES, WEIGHT_LEFT_MAX_ROWS, project


def _weight_left(rows: int, out: int) -> bool:
    """The CPU form the docstring promises: W @ x^T for 2..WEIGHT_LEFT_MAX_ROWS rows with a small result."""
    return (
        jax.default_backend() == "cpu"
        and 2 <= rows <= WEIGHT_LEFT_MAX_ROWS
        and rows * out * 4 <= WEIGHT_LEFT_MAX_OUT_BYTES
    )


@pytest.mark.parametrize("lead", [(1, 1), (1, 3), (4, 16), (2, 64), (1, 200)])
@pytest.mark.parametrize(
    "out_shape,in_shape",
    [((48,), (32,)), ((3, 16), (32,)), ((32,), (3, 16)), ((9000,), (16,))],  # MLP, q/k/v, o, a vocabulary
)
def test_project_matches_einsum(lead, out_shape, in_shape):
    rng = np.random.default_rng(sum(lead) + len(out_shape))
    x = rng.standard_normal((*lead, *in_shape)).astype(np.float32)
    w = rng.standard_normal((*out_shape, *in_shape)).astype(np.float32)
    n_out, n_in = len(out_shape), len(in_shape)
    letters_out, letters_in = "pqr"[:n_out], "ijk"[:n_in]
    want = np.einsum(f"ab{letters_in},{letters_out}{letters_in}->ab{letters_out}", x, w)
    got = jax.jit(project, static_argnums=2)(jnp.asarray(x), jnp.asarray(w), n_in)
    assert got.shape == want.shape
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-4)


@pytest.mark.parametrize("rows,out", [(1, 48), (8, 48), (128, 48), (129, 48), (64, 40000)])
def test_project_picks_the_measured_form(rows, out):
    """The weight-left form, and only it, carries the barrier that keeps XLA from folding its transpose."""
    x, w = jnp.ones((rows, 32), jnp.float32), jnp.ones((out, 32), jnp.float32)
    text = jax.jit(project, static_argnums=2).lower(x, w, 1).as_text()
    assert ("optimization_barrier" in text) == _weight_left(rows, out)
