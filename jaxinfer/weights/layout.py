"""From checkpoint tensors in PyTorch layout (HF names, Linear weights f[out, in]) to our params pytree.

Every loader reduces its format to `get(hf_name) -> np.ndarray | None` in PyTorch layout; this module does the
one conversion into our layout ([in, out], heads as their own axis). `place` decides where each converted leaf
goes (plain device array, or a sharded array placed shard by shard).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.model.transformer import Params, param_axes, param_shapes

Getter = Callable[[str], "np.ndarray | None"]
# (path like "layers/3/q", numpy array in our layout, logical axes) -> device array
Placer = Callable[[str, np.ndarray, tuple[str, ...]], jax.Array]

_ATTN = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj"}


def hf_name(cfg: ModelConfig, path: tuple) -> str:
    """HF checkpoint name of one of our leaves, e.g. ("layers", 3, "q") -> model.layers.3.self_attn.q_proj.weight."""
    if path == ("embed",):
        return "model.embed_tokens.weight"
    if path == ("final_norm",):
        return "model.norm.weight"
    if path == ("lm_head",):
        return "lm_head.weight"
    _, i, *rest = path
    pre = f"model.layers.{i}."
    if rest[0] == "mlp":
        name, suffix = (rest[1][: -len("_bias")], "bias") if rest[1].endswith("_bias") else (rest[1], "weight")
        return f"{pre}mlp.{name}_proj.{suffix}"
    key = rest[0]
    if key in _ATTN:
        return f"{pre}self_attn.{_ATTN[key]}.weight"
    if key.endswith("_bias"):
        return f"{pre}self_attn.{_ATTN[key[0]]}.bias"
    if key in ("q_norm", "k_norm"):
        return f"{pre}self_attn.{key}.weight"
    gemma = cfg.sandwich_norm
    norms = {
        "attn_norm": "input_layernorm",
        # Sandwich-norm families name the pre-MLP norm differently from Llama, where
        # "post_attention_layernorm" *is* the pre-MLP norm.
        "mlp_norm": "pre_feedforward_layernorm" if gemma else "post_attention_layernorm",
        "post_attn_norm": "post_attention_layernorm",
        "post_mlp_norm": "post_feedforward_layernorm",
    }
    return f"{pre}{norms[key]}.weight"


def _to_our_layout(cfg: ModelConfig, key: str, w: np.ndarray) -> np.ndarray:
    d, h, kv, dh = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    if key == "lm_head" or key in ("gate", "up", "down"):
        return w.T
    if key == "q":
        return w.T.reshape(d, h, dh)
    if key in ("k", "v"):
        return w.T.reshape(d, kv, dh)
    if key == "o":
        return w.T.reshape(h, dh, d)
    if key == "q_bias":
        return w.reshape(h, dh)
    if key in ("k_bias", "v_bias"):
        return w.reshape(kv, dh)
    return w


def default_placer(dtype: str) -> Placer:
    def place(path: str, x: np.ndarray, axes: tuple[str, ...]) -> jax.Array:
        return jnp.asarray(x, dtype=jnp.dtype(dtype))

    return place


def build_params(cfg: ModelConfig, get: Getter, place: Placer | None = None) -> Params:
    """Fetches, converts and places every leaf; a missing or mis-shaped tensor is an error naming it."""
    place = place or default_placer(cfg.dtype)
    axes = param_axes(cfg)

    def walk(shape_tree: Any, axes_tree: Any, path: tuple) -> Any:
        if isinstance(shape_tree, dict):
            return {k: walk(shape_tree[k], axes_tree[k], (*path, k)) for k in shape_tree}
        if isinstance(shape_tree, list):
            return [walk(s, a, (*path, i)) for i, (s, a) in enumerate(zip(shape_tree, axes_tree, strict=True))]
        name = hf_name(cfg, path)
        w = get(name)
        if w is None:
            raise ValueError(f"checkpoint is missing tensor {name!r} (needed for {'/'.join(map(str, path))})")
        x = _to_our_layout(cfg, path[-1], np.asarray(w))
        if tuple(x.shape) != tuple(shape_tree):
            raise ValueError(
                f"tensor {name!r} has shape {tuple(np.shape(w))}, which does not fit the config "
                f"(expected {tuple(shape_tree)} in our layout)"
            )
        return place("/".join(map(str, path)), x, axes_tree)

    return walk(param_shapes(cfg), axes, ())


def build_on_mesh(cfg: ModelConfig, get: Getter, dtype: str, mesh: Any = None) -> tuple[ModelConfig, Params]:
    """build_params on one device, or shard by shard on a mesh. Returns the config the params fit: on a mesh
    with more model shards than KV heads, the KV heads are replicated (see jaxinfer.sharding)."""
    if mesh is None:
        return cfg, build_params(cfg, get, default_placer(dtype))
    from jaxinfer.sharding import MODEL, placer, sharded_config

    place = placer(cfg, mesh, dtype)  # checks the split before any tensor is read
    return sharded_config(cfg, mesh.shape[MODEL]), build_params(cfg, get, place)
