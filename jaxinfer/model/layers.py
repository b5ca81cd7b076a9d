"""The shared layers every family is built from, as Flax NNX modules, and the pure functions behind them.

Every parameter names its logical axes in Flax sharding metadata (`out_sharding`); `jaxinfer.sharding` maps those
names to mesh axes with a rules table. Parameters are created with `eager_sharding=False`: the module only names
axes, placement happens once, when the weights are loaded onto a mesh.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer.config import RopeConfig, rope_inv_freq

Initializer = Callable[..., jax.Array]


def param(rngs: nnx.Rngs, init: Initializer, shape: tuple[int, ...], axes: tuple[str, ...], dtype) -> nnx.Param:
    """A parameter of `shape` whose logical axis names travel with it as Flax sharding metadata."""
    assert len(axes) == len(shape), (shape, axes)
    return nnx.Param(init(rngs.params(), shape, jnp.dtype(dtype)), out_sharding=axes, eager_sharding=False)


def rms_norm(x: jax.Array, w: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    """RMSNorm computed in f32 (as HF does), scaled by (offset + w); Gemma stores w with offset 1."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * (offset + w.astype(jnp.float32))).astype(x.dtype)


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis, scaled by (offset + scale). The scale starts at the identity (1 - offset)."""

    def __init__(self, dim: int, eps: float, offset: float, axis: str, *, dtype, rngs: nnx.Rngs):
        self.eps, self.offset = eps, offset
        self.scale = param(rngs, nnx.initializers.constant(1.0 - offset), (dim,), (axis,), dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.scale[...], self.eps, self.offset)


class Embed(nnx.Module):
    """Token embedding f[V, D]; `scale` multiplies by sqrt(D) (Gemma); `attend` gives tied logits."""

    def __init__(self, vocab: int, dim: int, scale: bool, *, dtype, std: float = 0.02, rngs: nnx.Rngs):
        self.scale = scale
        self.embedding = param(rngs, nnx.initializers.normal(std), (vocab, dim), ("vocab", "embed"), dtype)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = jnp.take(self.embedding[...], tokens, axis=0)
        if self.scale:
            # HF Gemma casts the normalizer to the activation dtype before multiplying.
            x = x * jnp.asarray(x.shape[-1] ** 0.5, dtype=x.dtype)
        return x


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerSelect:
    """One layer's kernel inside a loop over layers: per-layer arrays and the traced layer index.

    A loop over stacked weights slices each layer's kernel out of the stack, and XLA:CPU copies a dynamic slice
    before a matmul reads it (unrolled layers ran a batch-1 decode step 1.16x faster, benchmarks/README.md). A
    `lax.switch` over the layers' own arrays runs each matmul on the parameter buffer itself. `Einsum` takes one
    in place of an array (`jaxinfer.model.scanned` builds them)."""

    arrays: tuple[jax.Array, ...]
    index: jax.Array  # i32[]

    def __getitem__(self, key):
        if key is not Ellipsis:
            raise TypeError("a LayerSelect is read whole ([...]) by Einsum")
        return self  # what `Param[...]` hands to Einsum

    def einsum(self, equation: str, x: jax.Array) -> jax.Array:
        branches = [lambda x, w=w: jnp.einsum(equation, x, w) for w in self.arrays]
        return jax.lax.switch(self.index, branches, x)


class Einsum(nnx.Module):
    """A projection as one einsum (heads kept as their own axis), with an optional bias over its output axes."""

    def __init__(
        self,
        equation: str,
        shape: tuple[int, ...],
        axes: tuple[str, ...],
        *,
        bias: tuple[tuple[int, ...], tuple[str, ...]] | None = None,
        dtype,
        std: float = 0.02,
        rngs: nnx.Rngs,
    ):
        self.equation = equation
        self.kernel = param(rngs, nnx.initializers.normal(std), shape, axes, dtype)
        self.bias = param(rngs, nnx.initializers.normal(std), *bias, dtype) if bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        w = self.kernel[...]
        y = w.einsum(self.equation, x) if isinstance(w, LayerSelect) else jnp.einsum(self.equation, x, w)
        return y if self.bias is None else y + self.bias[...]


def activation(name: str, x: jax.Array) -> jax.Array:
    if name == "silu":
        return jax.nn.silu(x)
    if name == "gelu_tanh":
        return jax.nn.gelu(x, approximate=True)
    return jax.nn.gelu(x, approximate=False)


class GatedMLP(nnx.Module):
    """SwiGLU / GeGLU: down(act(gate(x)) * up(x)). x f[B, T, D]."""

    def __init__(self, dim: int, hidden: int, act: str, use_bias: bool, *, dtype, std: float, rngs: nnx.Rngs):
        self.act = act
        kw = dict(dtype=dtype, std=std, rngs=rngs)
        up_bias = ((hidden,), ("mlp",)) if use_bias else None
        self.gate = Einsum("...d,df->...f", (dim, hidden), ("embed", "mlp"), bias=up_bias, **kw)
        self.up = Einsum("...d,df->...f", (dim, hidden), ("embed", "mlp"), bias=up_bias, **kw)
        down_bias = ((dim,), ("embed",)) if use_bias else None
        self.down = Einsum("...f,fd->...d", (hidden, dim), ("mlp", "embed"), bias=down_bias, **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(activation(self.act, self.gate(x)) * self.up(x))


def rope_tables(rope: RopeConfig, head_dim: int, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin f32[..., head_dim] for integer positions i32[...] (rotate-half layout, as HF)."""
    inv_freq, scale = rope_inv_freq(rope, head_dim)
    inv = jnp.asarray(np.asarray(inv_freq, dtype=np.float32))
    angles = positions.astype(jnp.float32)[..., None] * inv  # f32[..., head_dim // 2]
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles) * scale, jnp.sin(angles) * scale


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x f[B, T, H, D]; cos/sin f32[B, T, D]. Rotation in f32, result in x's dtype."""
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    out = xf * cos[:, :, None, :] + rotated * sin[:, :, None, :]
    return out.astype(x.dtype)


def soft_cap(x: jax.Array, cap: float | None) -> jax.Array:
    return x if cap is None else cap * jnp.tanh(x / cap)
