"""Attention against a contiguous per-sequence KV cache: the simple, obviously-correct path.

The paged engine uses `kernels_pallas` instead; this path is the foundation's reference generator and what the
parity tests against transformers run.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.config import ModelConfig
from jaxinfer.model.layers import soft_cap
from jaxinfer.model.transformer import AttentionFn


def masked_attention(
    q: jax.Array,  # f[B, T, H, Dh]
    k: jax.Array,  # f[B, S, Hkv, Dh]
    v: jax.Array,  # f[B, S, Hkv, Dh]
    q_pos: jax.Array,  # i32[B, T] absolute position of each query
    kv_pos: jax.Array,  # i32[B, S] absolute position of each key (or -1 where the slot is empty)
    *,
    scale: float,
    window: int = 0,
    cap: float | None = None,
) -> jax.Array:
    """Causal (optionally sliding-window) GQA attention, softmax in f32. Returns f[B, T, H, Dh]."""
    b, t, h, dh = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, t, hkv, h // hkv, dh)  # query heads grouped by the KV head they read
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    scores = soft_cap(scores, cap)
    qp, kp = q_pos[:, :, None], kv_pos[:, None, :]
    allowed = (kp >= 0) & (kp <= qp)
    if window:
        allowed &= qp - kp < window
    scores = jnp.where(allowed[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    # A query with nothing to attend to (padding) gets zeros rather than NaN.
    probs = jnp.where(allowed[:, None, None].any(-1, keepdims=True), probs, 0.0)
    out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v.dtype), v)
    return out.reshape(b, t, h, dh)


def init_contiguous_cache(cfg: ModelConfig, batch: int, max_len: int) -> list[tuple[jax.Array, jax.Array]]:
    """Per-layer (k, v) f[B, S, Hkv, Dh], zeros."""
    shape = (batch, max_len, cfg.num_kv_heads, cfg.head_dim)
    dtype = jnp.dtype(cfg.dtype)
    return [(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(cfg.num_layers)]


def contiguous_attend(cfg: ModelConfig, positions: jax.Array, valid: jax.Array) -> AttentionFn:
    """An AttentionFn writing the new K/V at their positions (tokens with valid=False are dropped), then
    attending over the whole cache. positions i32[B, T]; valid bool[B, T]."""

    def attend(i: int, q, k, v, cache, /):
        kc, vc = cache
        s = kc.shape[1]
        rows = jnp.arange(q.shape[0])[:, None]
        slots = jnp.where(valid, positions, s)  # out of range -> dropped by the scatter
        kc = kc.at[rows, slots].set(k.astype(kc.dtype), mode="drop")
        vc = vc.at[rows, slots].set(v.astype(vc.dtype), mode="drop")
        kv_pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (q.shape[0], s))
        out = masked_attention(
            q,
            kc,
            vc,
            positions,
            kv_pos,
            scale=cfg.scale,
            window=cfg.layer_windows[i],
            cap=cfg.attn_logit_softcap,
        )
        return out, (kc, vc)

    return attend
