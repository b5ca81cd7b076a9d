"""`lookup`: the embedding rows, by gather or (for a TPU table of a width that is not whole 128-lane rows) by a one-hot
matmul, equal numpy's indexing bit for bit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.model.layers import lookup


@pytest.mark.parametrize("one_hot", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("tokens_shape", [(1,), (32,), (2, 7)])
def test_lookup_is_exact(one_hot, dtype, tokens_shape):
    rng = np.random.default_rng(len(tokens_shape))
    table = jnp.asarray(rng.standard_normal((300, 576)) * 3.0, dtype)  # SmolLM2's width, a vocabulary of 300
    tokens = jnp.asarray(rng.integers(0, 300, tokens_shape), jnp.int32)
    got = jax.jit(lookup, static_argnames="one_hot")(table, tokens, one_hot=one_hot)
    assert got.dtype == dtype and got.shape == (*tokens_shape, 576)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(table, np.float32)[np.asarray(tokens)])
