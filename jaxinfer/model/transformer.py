"""The decoder families (Llama/Mistral, Qwen2, Qwen3, Gemma 3) as one Flax NNX module configured by ModelConfig.

State layout (`nnx.state(Transformer(cfg))`; kernels output-major, f[out, in], as PyTorch's Linear; the Q/K/V
outputs keep heads as their own axes; logical axes in each Param's metadata):
    embedder/embedding                f[V, D]        ("vocab", "embed")
    final_norm/scale                  f[D]           ("norm",)
    lm_head/kernel   (untied only)    f[V, D]        ("vocab", "embed")
    layers/i:
      attn_norm, mlp_norm /scale      f[D]
      post_attn_norm, post_mlp_norm   f[D]           (sandwich-norm families: Gemma 3)
      attn/q/kernel f[H, Dh, D]   attn/k, attn/v /kernel f[Hkv, Dh, D]   attn/o/kernel f[D, H*Dh]
      attn/{q,k,v}/bias f[H|Hkv, Dh]   attn/o/bias f[D]                  (when configured)
      attn/q_norm, attn/k_norm /scale f[Dh]                              (qk-norm families)
      mlp/gate, mlp/up /kernel f[F, D]   mlp/down/kernel f[D, F]         (+ biases when configured)

The output projection reads the heads flattened, f[D, H*Dh], as PyTorch stores it: a kernel with one input axis
is what XLA:CPU's one-row dot reads at the memory's pace (`jaxinfer.model.layers.project`).

Attention against the KV cache is a function passed in (`AttentionFn`), so the same block runs on the contiguous
cache (`jaxinfer.model.attention`) and on the engine's paged pools. The module holds weights only: the KV cache
goes in and comes out of every call. The engine splits it once (`jaxinfer.model.functional`) and merges inside
its jitted steps, so weights are arguments of the compiled program, never constants baked into it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer.config import ModelConfig
from jaxinfer.model.layers import (
    Embed,
    GatedMLP,
    Linear,
    RMSNorm,
    abstract_params,
    apply_rope,
    project,
    rope_tables,
    soft_cap,
)

Params = nnx.State
# (layer index, q f[B,T,H,Dh], k f[B,T,Hkv,Dh], v f[B,T,Hkv,Dh], layer cache) -> (out f[B,T,H,Dh], layer cache)
AttentionFn = Callable[[int, jax.Array, jax.Array, jax.Array, Any], tuple[jax.Array, Any]]


class Attention(nnx.Module):
    """Q/K/V/O projections, optional QK-norm and RoPE around an injected attention function."""

    def __init__(self, cfg: ModelConfig, index: int, *, std: float, rngs: nnx.Rngs):
        d, h, kv, dh = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        kw = dict(dtype=cfg.dtype, std=std, rngs=rngs)
        bias = cfg.qkv_bias
        self.index = index
        self.q = Linear((h, dh), (d,), ("q_heads", "head_dim", "embed"), bias=bias, **kw)
        self.k = Linear((kv, dh), (d,), ("kv_heads", "head_dim", "embed"), bias=bias, **kw)
        self.v = Linear((kv, dh), (d,), ("kv_heads", "head_dim", "embed"), bias=bias, **kw)
        self.o = Linear((d,), (h * dh,), ("embed", "q_heads"), bias=cfg.out_bias, **kw)
        norm = dict(eps=cfg.norm_eps, offset=cfg.norm_offset, axis="head_dim", dtype=cfg.dtype, rngs=rngs)
        self.q_norm = RMSNorm(dh, **norm) if cfg.qk_norm else None
        self.k_norm = RMSNorm(dh, **norm) if cfg.qk_norm else None

    def __call__(self, x: jax.Array, cos_sin: tuple, attend: AttentionFn, cache: Any) -> tuple[jax.Array, Any]:
        q, k, v = self.q(x), self.k(x), self.v(x)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, *cos_sin), apply_rope(k, *cos_sin)
        out, cache = attend(self.index, q, k, v, cache)
        return self.o(out.reshape(*out.shape[:-2], -1)), cache


class Block(nnx.Module):
    """One decoder block: pre-norm attention and gated MLP, with Gemma's extra post-norms when configured."""

    def __init__(self, cfg: ModelConfig, index: int, *, std: float, rngs: nnx.Rngs):
        d = cfg.hidden_size
        norm = dict(eps=cfg.norm_eps, offset=cfg.norm_offset, axis="norm", dtype=cfg.dtype, rngs=rngs)
        self.local = bool(cfg.layer_windows[index])  # sliding layers use the local RoPE table
        self.attn_norm = RMSNorm(d, **norm)
        self.attn = Attention(cfg, index, std=std, rngs=rngs)
        self.post_attn_norm = RMSNorm(d, **norm) if cfg.sandwich_norm else None
        self.mlp_norm = RMSNorm(d, **norm)
        self.mlp = GatedMLP(d, cfg.intermediate_size, cfg.activation, cfg.mlp_bias, dtype=cfg.dtype, std=std,
                            rngs=rngs)  # fmt: skip
        self.post_mlp_norm = RMSNorm(d, **norm) if cfg.sandwich_norm else None

    def __call__(self, x: jax.Array, ropes: dict, attend: AttentionFn, cache: Any) -> tuple[jax.Array, Any]:
        out, cache = self.attn(self.attn_norm(x), ropes["local" if self.local else "global"], attend, cache)
        if self.post_attn_norm is not None:
            out = self.post_attn_norm(out)
        x = x + out
        out = self.mlp(self.mlp_norm(x))
        if self.post_mlp_norm is not None:
            out = self.post_mlp_norm(out)
        return x + out, cache


class Transformer(nnx.Module):
    """A built-in family; follows `jaxinfer.model.protocol.DecoderModel`."""

    def __init__(self, cfg: ModelConfig, *, std: float = 0.02, rngs: nnx.Rngs):
        self.config = cfg
        self.embedder = Embed(cfg.vocab_size, cfg.hidden_size, cfg.embed_scale, dtype=cfg.dtype, std=std, rngs=rngs)
        self.layers = nnx.List([Block(cfg, i, std=std, rngs=rngs) for i in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, cfg.norm_offset, "norm", dtype=cfg.dtype, rngs=rngs)
        head = ((cfg.vocab_size,), (cfg.hidden_size,), ("vocab", "embed"))
        self.lm_head = None if cfg.tie_word_embeddings else Linear(*head, dtype=cfg.dtype, std=std, rngs=rngs)

    def __call__(
        self,
        tokens: jax.Array,  # i32[B, T]
        positions: jax.Array,  # i32[B, T]
        kv_cache: list,  # one entry per layer, opaque to the model
        attend: AttentionFn,
    ) -> tuple[jax.Array, list]:
        """Runs all blocks (unrolled); returns the final-normed hidden states f[B, T, D] and the updated cache."""
        cfg = self.config
        x = self.embedder(tokens)
        ropes = {"global": rope_tables(cfg.rope, cfg.head_dim, positions)}
        ropes["local"] = rope_tables(cfg.rope_local, cfg.head_dim, positions) if cfg.rope_local else ropes["global"]
        new_cache = []
        for block, layer_cache in zip(self.layers, kv_cache, strict=True):
            x, layer_cache = block(x, ropes, attend, layer_cache)
            new_cache.append(layer_cache)
        return self.final_norm(x), new_cache

    def logits(self, hidden: jax.Array) -> jax.Array:
        """f32 logits f32[..., V] for final hidden states f[..., D]."""
        w = self.embedder.embedding[...] if self.lm_head is None else self.lm_head.kernel[...]  # f[V, D]
        out = project(hidden, w, 1, jnp.float32)
        return soft_cap(out, self.config.final_logit_softcap)


@functools.lru_cache(maxsize=32)
def abstract_model(cfg: ModelConfig) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, abstract state) of a family: shapes, dtypes and logical axes, no arrays allocated."""
    with abstract_params():
        model = Transformer(cfg, rngs=nnx.Rngs(0))
    # A pytree round trip, as eval_shape's output made: it orders each Variable's metadata as jax's unflatten does,
    # and the graphdef's repr (part of the executable cache's keys) shows that order. Without it, a start that
    # restores the weights missed the entries a start that converted them had stored.
    return nnx.split(jax.tree.map(lambda x: x, model))


def init_params(cfg: ModelConfig, seed: int = 0, std: float = 0.02) -> Params:
    """Random weights at the config's shapes (benchmarks, tests), drawn with numpy on the host (the same on every
    backend and process). Norm weights start at their identity."""
    rng = np.random.default_rng(seed)
    dtype = jnp.dtype(cfg.dtype)

    def make(path: tuple, v: nnx.Variable) -> nnx.Variable:
        if path[-2].endswith("norm"):
            return v.replace(jnp.full(v.shape, 1.0 - cfg.norm_offset, dtype))
        return v.replace(jnp.asarray(rng.standard_normal(v.shape, dtype=np.float32) * std, dtype))

    return nnx.map_state(make, abstract_model(cfg)[1])


def check_params(cfg: ModelConfig, params: Params) -> None:
    """Raises ValueError naming the first parameter whose presence or shape differs from the config."""
    want = dict(abstract_model(cfg)[1].flat_state())
    got = dict(params.flat_state()) if isinstance(params, nnx.State) else {}
    for path in sorted(set(want) | set(got), key=str):
        name = "/".join(map(str, path))
        if path not in got:
            raise ValueError(f"params: missing {name}")
        if path not in want:
            raise ValueError(f"params: unexpected {name} for this config")
        if tuple(got[path].shape) != tuple(want[path].shape):
            raise ValueError(f"param {name}: expected shape {tuple(want[path].shape)}, got {tuple(got[path].shape)}")


def merge(cfg: ModelConfig, params: Params) -> Transformer:
    return nnx.merge(abstract_model(cfg)[0], params)


def forward(
    params: Params, cfg: ModelConfig, tokens: jax.Array, positions: jax.Array, kv_cache: list, attend: AttentionFn
) -> tuple[jax.Array, list]:
    """The family's forward as a function of its state (for jitted callers holding (cfg, state))."""
    return merge(cfg, params)(tokens, positions, kv_cache, attend)


def logits(params: Params, cfg: ModelConfig, hidden: jax.Array) -> jax.Array:
    return merge(cfg, params).logits(hidden)
