"""`rms_norm` and its `pairwise_sum`: equal to numpy's float64 norm, and, on XLA:CPU, a row's norm bit-identical
whatever rows share its step (XLA's own reduction changed with the fusion around it)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.model.layers import pairwise_sum, project, rms_norm


@pytest.mark.parametrize("width", [1, 5, 64, 576, 1000, 1024])
def test_pairwise_sum_is_the_sum(width):
    x = np.random.default_rng(width).standard_normal((3, width)).astype(np.float32)
    got = np.asarray(jax.jit(pairwise_sum)(jnp.asarray(x)))
    assert got.shape == (3, 1)
    np.testing.assert_allclose(got[:, 0], x.astype(np.float64).sum(-1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_matches_float64(offset):
    rng = np.random.default_rng(7)
    x, w = rng.standard_normal((4, 576)).astype(np.float32), rng.standard_normal(576).astype(np.float32)
    want = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-5) * (offset + w)
    got = np.asarray(jax.jit(lambda x, w: rms_norm(x, w, 1e-5, offset))(jnp.asarray(x), jnp.asarray(w)))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's fusions")
def test_a_rows_norm_does_not_depend_on_the_rows_beside_it():
    """Residual blocks at SmolLM2's shapes, as a step runs them: each norm fused with the residual add before it.
    With jnp.mean, XLA:CPU's reduction gave the third block's first norm other bits at 8 and 16 rows than at 1 and
    2 (and every value after it)."""
    rng = np.random.default_rng(0)
    shapes = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # q, k and v; o; gate and up; down
    ws = [[jnp.asarray(rng.standard_normal(s, dtype=np.float32) * 0.02) for s in shapes] for _ in range(4)]
    scale = jnp.asarray(rng.standard_normal(576, dtype=np.float32))

    @jax.jit
    def blocks(x):
        norms = []
        for qkv, o, gate_up, down in ws:
            h = rms_norm(x, scale, 1e-5)
            norms.append(h)
            x = x + project(project(h, qkv, 1)[:, :576], o, 1)
            h = project(rms_norm(x, scale, 1e-5), gate_up, 1)
            norms.append(h)
            x = x + project(jax.nn.silu(h[:, :1536]) * h[:, 1536:], down, 1)
        return norms

    x = jnp.asarray(rng.standard_normal((16, 576), dtype=np.float32))
    first = {rows: [np.asarray(n)[0] for n in blocks(x[:rows])] for rows in (1, 2, 8, 16)}
    for rows, norms in first.items():
        for i, (got, want) in enumerate(zip(norms, first[1], strict=True)):
            np.testing.assert_array_equal(got, want, err_msg=f"value {i} at {rows} rows")
