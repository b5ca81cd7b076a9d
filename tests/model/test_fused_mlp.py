"""`GatedMLP.fuse_projections`: gate and up as one kernel f[2, F, D] compute what the two did, against numpy's
own gated MLP over the same weights, and `unfuse_projections` gives the two kernels back bit for bit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxinfer.model.layers import GatedMLP


def _numpy_mlp(x: np.ndarray, p: dict[str, np.ndarray], act: str) -> np.ndarray:
    def lin(name: str, h: np.ndarray) -> np.ndarray:
        return h @ p[f"{name}/kernel"].T + p.get(f"{name}/bias", 0.0)

    g = lin("gate", x)
    if act == "silu":
        a = g / (1.0 + np.exp(-g))
    else:  # gelu_tanh
        a = 0.5 * g * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (g + 0.044715 * g**3)))
    return lin("down", a * lin("up", x))


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("lead", [(1, 1), (1, 5), (3, 40), (1, 200)])  # one row, a decode batch, prompts
@pytest.mark.parametrize("dim, hidden", [(16, 48), (40, 72)])
def test_fused_gate_up_matches_numpy_and_unfuses_exactly(lead, dim, hidden, act, bias):
    mlp = GatedMLP(dim, hidden, act, bias, dtype="float32", std=0.3, rngs=nnx.Rngs(sum(lead) + dim))
    before = {"/".join(map(str, k)): np.asarray(v[...]) for k, v in nnx.to_flat_state(nnx.state(mlp))}
    x = np.random.default_rng(dim).standard_normal((*lead, dim)).astype(np.float32)
    want = _numpy_mlp(x.astype(np.float64), {k: v.astype(np.float64) for k, v in before.items()}, act)

    mlp.fuse_projections()
    assert mlp.gate is None and mlp.up is None
    assert mlp.gate_up.kernel.shape == (2, hidden, dim)
    graphdef, state = nnx.split(mlp)
    got = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))(state, jnp.asarray(x))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)

    mlp.unfuse_projections()
    after = {"/".join(map(str, k)): np.asarray(v[...]) for k, v in nnx.to_flat_state(nnx.state(mlp))}
    assert after.keys() == before.keys()
    for name, value in before.items():
        np.testing.assert_array_equal(after[name], value, err_msg=name)
