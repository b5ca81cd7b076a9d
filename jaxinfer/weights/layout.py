"""From checkpoint tensors in PyTorch layout (HF names, Linear weights f[out, in]) to a family's nnx state.

Every loader reduces its format to `get(hf_name) -> np.ndarray | None` in PyTorch layout; this module does the
one conversion into the module's layout (kernels output-major as PyTorch's, heads as their own axes: a reshape),
walking the abstract state of `jaxinfer.model.Transformer(cfg)`. `place` decides where each converted leaf goes
(plain device array, or a sharded array placed shard by shard from the parameter's logical axes).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer.config import ModelConfig
from jaxinfer.model.transformer import Params, abstract_model
from jaxinfer.sharding import var_axes

Getter = Callable[[str], "np.ndarray | None"]
# (state path like ("layers", 3, "attn", "q", "kernel"), numpy array in our layout, logical axes) -> device array
Placer = Callable[[tuple, np.ndarray, tuple[str, ...]], jax.Array]

_NORMS = {"attn_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm",
          "post_mlp_norm": "post_feedforward_layernorm"}  # fmt: skip


def hf_name(cfg: ModelConfig, path: tuple) -> str:
    """HF checkpoint name of a state leaf, e.g. ("layers", 3, "attn", "q", "kernel") ->
    model.layers.3.self_attn.q_proj.weight."""
    top = {("embedder", "embedding"): "model.embed_tokens.weight", ("final_norm", "scale"): "model.norm.weight",
           ("lm_head", "kernel"): "lm_head.weight"}  # fmt: skip
    if tuple(path) in top:
        return top[tuple(path)]
    _, i, *rest = path
    pre, suffix = f"model.layers.{i}.", "bias" if rest[-1] == "bias" else "weight"
    if rest[0] == "attn":
        proj = rest[1] if rest[1].endswith("norm") else f"{rest[1]}_proj"  # q_norm, k_norm keep their names
        return f"{pre}self_attn.{proj}.{suffix}"
    if rest[0] == "mlp":
        return f"{pre}mlp.{rest[1]}_proj.{suffix}"
    # Sandwich-norm families name the pre-MLP norm differently from Llama, where
    # "post_attention_layernorm" *is* the pre-MLP norm.
    if rest[0] == "mlp_norm":
        return f"{pre}{'pre_feedforward_layernorm' if cfg.sandwich_norm else 'post_attention_layernorm'}.weight"
    return f"{pre}{_NORMS[rest[0]]}.weight"


def torch_shape(path: tuple, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The PyTorch-layout shape of a leaf of our `shape`: Linear weights are [out, in], flattened over heads (every
    kernel's input is its last axis)."""
    if path[-1] != "kernel":
        return (shape[0], math.prod(shape[1:])) if path[-1] == "embedding" else (math.prod(shape),)
    return (math.prod(shape[:-1]), shape[-1])


def to_torch_layout(path: tuple, x: np.ndarray) -> np.ndarray:
    """A leaf in PyTorch's layout, the inverse of the loader's reshape (exports, tests that serve our weights
    through the HF loading path)."""
    want = torch_shape(path, x.shape)
    return x.reshape(want)


def default_placer(dtype: str) -> Placer:
    def place(path: tuple, x: np.ndarray, axes: tuple[str, ...]) -> jax.Array:
        return jnp.asarray(x, dtype=jnp.dtype(dtype))

    return place


def build_params(cfg: ModelConfig, get: Getter, place: Placer | None = None) -> Params:
    """Fetches, converts and places every leaf of the family's state; a missing or mis-shaped tensor is an error
    naming it."""
    place = place or default_placer(cfg.dtype)

    def fill(path: tuple, v: nnx.Variable) -> nnx.Variable:
        name = hf_name(cfg, path)
        w = get(name)
        if w is None:
            raise ValueError(f"checkpoint is missing tensor {name!r} (needed for {'/'.join(map(str, path))})")
        w = np.asarray(w)
        want = torch_shape(path, tuple(v.shape))
        if w.size != math.prod(want) or (w.ndim == len(want) and tuple(w.shape) != want):
            raise ValueError(
                f"tensor {name!r} has shape {tuple(w.shape)}, which does not fit the config (expected {want})"
            )
        return v.replace(place(path, w.reshape(v.shape), var_axes(v)))

    return nnx.map_state(fill, abstract_model(cfg)[1])


def build_on_mesh(cfg: ModelConfig, get: Getter, dtype: str, mesh: Any = None) -> tuple[ModelConfig, Params]:
    """build_params on one device, or shard by shard on a mesh. Returns the config the params fit: on a mesh
    with more model shards than KV heads, the KV heads are replicated (see jaxinfer.sharding)."""
    if mesh is None:
        return cfg, build_params(cfg, get, default_placer(dtype))
    from jaxinfer.sharding import MODEL, placer, sharded_config

    place = placer(cfg, mesh, dtype)  # checks the split before any tensor is read
    return sharded_config(cfg, mesh.shape[MODEL]), build_params(cfg, get, place)
