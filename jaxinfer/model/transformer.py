"""The decoder transformer as pure functions over a params pytree.

Params layout (one dict per layer, layers unrolled; heads kept as their own axis so that sharding is a rules
table over the logical names in `param_axes`):
    embed        f[V, D]                      ("vocab", "embed")
    final_norm   f[D]                         ("norm",)
    lm_head      f[D, V]  (untied only)       ("embed", "vocab")
    layers[i]:
      attn_norm, mlp_norm           f[D]
      post_attn_norm, post_mlp_norm f[D]      (sandwich-norm families: Gemma 3)
      q f[D, H, Dh]   k, v f[D, Hkv, Dh]   o f[H, Dh, D]
      q_bias f[H, Dh]  k_bias, v_bias f[Hkv, Dh]  o_bias f[D]   (when configured)
      q_norm, k_norm f[Dh]                    (qk-norm families)
      mlp: gate, up f[D, F]   down f[F, D]    (+ biases when configured)

Attention against the KV cache is a function passed in (`AttentionFn`), so the same block runs on the contiguous
cache here and on the paged cache of the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.model.layers import apply_rope, gated_mlp, rms_norm, rope_tables, soft_cap

Params = dict[str, Any]
# (layer index, q f[B,T,H,Dh], k f[B,T,Hkv,Dh], v f[B,T,Hkv,Dh], layer cache) -> (out f[B,T,H,Dh], layer cache)
AttentionFn = Callable[[int, jax.Array, jax.Array, jax.Array, Any], tuple[jax.Array, Any]]


def param_shapes(cfg: ModelConfig) -> Params:
    """Shapes of every parameter, as a pytree of tuples with the params' structure."""
    d, h, kv, dh, f = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    shapes: Params = {"embed": (cfg.vocab_size, d), "final_norm": (d,), "layers": []}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (d, cfg.vocab_size)
    for _ in range(cfg.num_layers):
        layer: Params = {
            "attn_norm": (d,),
            "mlp_norm": (d,),
            "q": (d, h, dh),
            "k": (d, kv, dh),
            "v": (d, kv, dh),
            "o": (h, dh, d),
            "mlp": {"gate": (d, f), "up": (d, f), "down": (f, d)},
        }
        if cfg.sandwich_norm:
            layer.update(post_attn_norm=(d,), post_mlp_norm=(d,))
        if cfg.qkv_bias:
            layer.update(q_bias=(h, dh), k_bias=(kv, dh), v_bias=(kv, dh))
        if cfg.out_bias:
            layer["o_bias"] = (d,)
        if cfg.qk_norm:
            layer.update(q_norm=(dh,), k_norm=(dh,))
        if cfg.mlp_bias:
            layer["mlp"].update(gate_bias=(f,), up_bias=(f,), down_bias=(d,))
        shapes["layers"].append(layer)
    return shapes


_AXES = {
    "embed": ("vocab", "embed"),
    "final_norm": ("norm",),
    "lm_head": ("embed", "vocab"),
    "attn_norm": ("norm",),
    "mlp_norm": ("norm",),
    "post_attn_norm": ("norm",),
    "post_mlp_norm": ("norm",),
    "q": ("embed", "q_heads", "head_dim"),
    "k": ("embed", "kv_heads", "head_dim"),
    "v": ("embed", "kv_heads", "head_dim"),
    "o": ("q_heads", "head_dim", "embed"),
    "q_bias": ("q_heads", "head_dim"),
    "k_bias": ("kv_heads", "head_dim"),
    "v_bias": ("kv_heads", "head_dim"),
    "o_bias": ("norm",),
    "q_norm": ("head_dim",),
    "k_norm": ("head_dim",),
    "gate": ("embed", "mlp"),
    "up": ("embed", "mlp"),
    "down": ("mlp", "embed"),
    "gate_bias": ("mlp",),
    "up_bias": ("mlp",),
    "down_bias": ("norm",),
}


def param_axes(cfg: ModelConfig) -> Params:
    """Logical axis names of every parameter, with the params' structure (leaves are tuples of names)."""

    def name_tree(tree: Params) -> Params:
        out: Params = {}
        for key, val in tree.items():
            if isinstance(val, dict):
                out[key] = name_tree(val)
            elif isinstance(val, list):
                out[key] = [name_tree(v) for v in val]
            else:
                out[key] = _AXES[key]
        return out

    return name_tree(param_shapes(cfg))


def init_params(cfg: ModelConfig, seed: int = 0, std: float = 0.02) -> Params:
    """Random weights at the config's shapes (benchmarks, tests). Norm weights start at their identity."""
    rng = np.random.default_rng(seed)
    dtype = jnp.dtype(cfg.dtype)

    def make(key: str, shape: tuple[int, ...]) -> jax.Array:
        if key.endswith("norm"):
            return jnp.full(shape, 1.0 - cfg.norm_offset, dtype)
        return jnp.asarray(rng.standard_normal(shape, dtype=np.float32) * std, dtype)

    def build(tree: Any, key: str = "") -> Any:
        if isinstance(tree, dict):
            return {k: build(v, k) for k, v in tree.items()}
        if isinstance(tree, list):
            return [build(v, key) for v in tree]
        return make(key, tree)

    return build(param_shapes(cfg))


def check_params(cfg: ModelConfig, params: Params) -> None:
    """Raises ValueError naming the first parameter whose presence or shape differs from the config."""
    want = param_shapes(cfg)

    def walk(w: Any, p: Any, path: str) -> None:
        if isinstance(w, dict):
            if not isinstance(p, dict) or set(w) != set(p):
                got = sorted(p) if isinstance(p, dict) else type(p).__name__
                raise ValueError(f"params at {path or '/'}: expected keys {sorted(w)}, got {got}")
            for k in w:
                walk(w[k], p[k], f"{path}/{k}")
        elif isinstance(w, list):
            if not isinstance(p, list | tuple) or len(p) != len(w):
                raise ValueError(f"params at {path}: expected {len(w)} layers")
            for i, (wi, pi) in enumerate(zip(w, p, strict=True)):
                walk(wi, pi, f"{path}/{i}")
        elif tuple(p.shape) != tuple(w):
            raise ValueError(f"param {path}: expected shape {tuple(w)}, got {tuple(p.shape)}")

    walk(want, params, "")


def _layer(
    cfg: ModelConfig, i: int, p: Params, x: jax.Array, cos_sin: tuple, attend: AttentionFn, cache: Any
) -> tuple[jax.Array, Any]:
    """One decoder block. x f[B, T, D]."""
    eps, off = cfg.norm_eps, cfg.norm_offset
    h = rms_norm(x, p["attn_norm"], eps, off)
    q = jnp.einsum("btd,dhk->bthk", h, p["q"])
    k = jnp.einsum("btd,dhk->bthk", h, p["k"])
    v = jnp.einsum("btd,dhk->bthk", h, p["v"])
    if cfg.qkv_bias:
        q, k, v = q + p["q_bias"], k + p["k_bias"], v + p["v_bias"]
    if cfg.qk_norm:
        q = rms_norm(q, p["q_norm"], eps, off)
        k = rms_norm(k, p["k_norm"], eps, off)
    cos, sin = cos_sin
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    attn, cache = attend(i, q, k, v, cache)
    out = jnp.einsum("bthk,hkd->btd", attn, p["o"])
    if cfg.out_bias:
        out = out + p["o_bias"]
    if cfg.sandwich_norm:
        out = rms_norm(out, p["post_attn_norm"], eps, off)
    x = x + out
    h = rms_norm(x, p["mlp_norm"], eps, off)
    out = gated_mlp(p["mlp"], h, cfg.activation)
    if cfg.sandwich_norm:
        out = rms_norm(out, p["post_mlp_norm"], eps, off)
    return x + out, cache


def embed(params: Params, cfg: ModelConfig, tokens: jax.Array) -> jax.Array:
    x = jnp.take(params["embed"], tokens, axis=0)
    if cfg.embed_scale:
        # HF Gemma casts the normalizer to the activation dtype before multiplying.
        x = x * jnp.asarray(cfg.hidden_size**0.5, dtype=x.dtype)
    return x


def forward(
    params: Params,
    cfg: ModelConfig,
    tokens: jax.Array,  # i32[B, T]
    positions: jax.Array,  # i32[B, T]
    kv_cache: list,  # one entry per layer, opaque to this function
    attend: AttentionFn,
) -> tuple[jax.Array, list]:
    """Runs all blocks; returns the final-normed hidden states f[B, T, D] and the updated per-layer cache."""
    x = embed(params, cfg, tokens)
    global_rope = rope_tables(cfg.rope, cfg.head_dim, positions)
    local_rope = rope_tables(cfg.rope_local, cfg.head_dim, positions) if cfg.rope_local else global_rope
    new_cache = []
    for i, p in enumerate(params["layers"]):
        cos_sin = local_rope if cfg.layer_windows[i] else global_rope
        x, layer_cache = _layer(cfg, i, p, x, cos_sin, attend, kv_cache[i])
        new_cache.append(layer_cache)
    return rms_norm(x, params["final_norm"], cfg.norm_eps, cfg.norm_offset), new_cache


def logits(params: Params, cfg: ModelConfig, hidden: jax.Array) -> jax.Array:
    """f32 logits f32[..., V] for final hidden states f[..., D]."""
    w = params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]
    out = jnp.matmul(hidden, w, preferred_element_type=jnp.float32)
    return soft_cap(out, cfg.final_logit_softcap)
