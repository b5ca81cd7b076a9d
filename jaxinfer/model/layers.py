"""Pure functions for the pieces of a decoder block. No state, no module objects: arrays in, arrays out."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import RopeConfig, rope_inv_freq


def rms_norm(x: jax.Array, w: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    """RMSNorm computed in f32 (as HF does), scaled by (offset + w); Gemma stores w with offset 1."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * (offset + w.astype(jnp.float32))).astype(x.dtype)


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


def activation(name: str, x: jax.Array) -> jax.Array:
    if name == "silu":
        return jax.nn.silu(x)
    if name == "gelu_tanh":
        return jax.nn.gelu(x, approximate=True)
    return jax.nn.gelu(x, approximate=False)


def gated_mlp(p: dict, x: jax.Array, act: str) -> jax.Array:
    """SwiGLU / GeGLU: down(act(x @ gate) * (x @ up)). x f[B, T, D]."""
    gate = x @ p["gate"]
    up = x @ p["up"]
    if "gate_bias" in p:
        gate, up = gate + p["gate_bias"], up + p["up_bias"]
    out = (activation(act, gate) * up) @ p["down"]
    if "down_bias" in p:
        out = out + p["down_bias"]
    return out


def soft_cap(x: jax.Array, cap: float | None) -> jax.Array:
    return x if cap is None else cap * jnp.tanh(x / cap)
