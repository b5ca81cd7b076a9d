"""Bring your own model: what a Flax NNX decoder must provide for jaxinfer to serve it.

A servable model is an `nnx.Module` with:

- `config`: a `jaxinfer.config.ModelConfig` (`arch="custom"` for a model of your own). The engine reads from it
  only what the KV cache and the attention kernels need: `num_layers`, `num_kv_heads`, `head_dim`, `dtype`
  (the cache's), `vocab_size`, `max_position_embeddings`, `scale` (`query_scale`), `layer_windows` and
  `attn_logit_softcap`. `num_heads`, `hidden_size`, `intermediate_size` are checked against tensor parallelism.
- `__call__(token_ids, positions, kv_cache, attend) -> (hidden, kv_cache)`:
    token_ids  i32[B, T]   the new tokens (the engine packs every sequence of a step on one axis: B == 1)
    positions  i32[B, T]   their absolute positions (RoPE is the model's business)
    kv_cache   list        one opaque entry per layer: pass entry i to `attend` and return what it gives back
    attend     AttentionFn (layer i, q f[B,T,H,Dh], k f[B,T,Hkv,Dh], v f[B,T,Hkv,Dh], kv_cache[i]), positionally
                              -> (out f[B,T,H,Dh], new kv_cache[i])
                           Causal attention over everything cached for the sequence, new tokens included: on the
                           engine's paged pools (the Pallas kernels through their dispatcher), or on a contiguous
                           cache (`jaxinfer.generate`). Call it once per layer, with k and v before any cache.
    hidden     f[B, T, D]  the final hidden states (after the final norm)
- `logits(hidden f[N, D]) -> f32[N, V]`: the engine calls it on the rows it samples from (2-D).

The module holds weights only (no cache, no step counter): the engine splits it once into (graphdef, state) and
its compiled steps merge it inside, so a module that mutates itself in `__call__` is not servable. That includes
dropout left on and batch norm collecting statistics: call `model.eval()` first.
`check_model` verifies all of this at load time by tracing one abstract call, and names the part that is missing.
Sampling, paged KV, continuous batching, prefix caching and sharding (from each Param's `out_sharding` logical
axes, see `jaxinfer.sharding.RULES`) are the engine's and apply unchanged.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxinfer.config import CUSTOM_ARCH, ModelConfig
from jaxinfer.model.transformer import AttentionFn, Transformer


class ProtocolError(TypeError):
    """A user model that does not follow the decoder protocol; the message names the missing part."""


@runtime_checkable
class DecoderModel(Protocol):
    config: ModelConfig

    def __call__(
        self, token_ids: jax.Array, positions: jax.Array, kv_cache: list, attend: AttentionFn
    ) -> tuple[jax.Array, list]: ...

    def logits(self, hidden: jax.Array) -> jax.Array: ...


def check_model(model: Any) -> ModelConfig:
    """Raises ProtocolError naming the first part of the protocol `model` misses; returns its config."""
    name = type(model).__name__
    if not isinstance(model, nnx.Module):
        raise ProtocolError(f"model: expected a flax.nnx.Module following jaxinfer.model.protocol, got {name}")
    cfg = getattr(model, "config", None)
    if not isinstance(cfg, ModelConfig):
        raise ProtocolError(
            f"{name}.config: missing or not a jaxinfer.config.ModelConfig (got {type(cfg).__name__}); it describes "
            "the KV cache the engine allocates (num_layers, num_kv_heads, head_dim, ...)"
        )
    if cfg.arch != CUSTOM_ARCH and not isinstance(model, Transformer):
        # The engine takes a built-in family's arch for its own module (merges, stacks and caches its layers).
        raise ProtocolError(
            f"{name}.config.arch: {cfg.arch!r} names a built-in family; a module of your own takes "
            f"arch={CUSTOM_ARCH!r} (jaxinfer.model.protocol)"
        )
    for method, sig in (("__call__", "(token_ids, positions, kv_cache, attend)"), ("logits", "(hidden)")):
        if not callable(getattr(type(model), method, None)):
            raise ProtocolError(f"{name}.{method}{sig}: missing (see jaxinfer.model.protocol)")
    _check_abstract_call(model, cfg, name)
    return cfg


def _check_abstract_call(model: nnx.Module, cfg: ModelConfig, name: str) -> None:
    """One call on abstract values (nothing computed): shapes in and out, one attend per layer on that layer's cache
    entry, the entries attend returned given back, the module's state unchanged, logits on 2-D rows."""
    b, t, n = 1, 2, cfg.num_layers
    calls: list[int] = []
    want_q, want_kv = (b, t, cfg.num_heads, cfg.head_dim), (b, t, cfg.num_kv_heads, cfg.head_dim)

    # Each layer's entry, and what attend returns for it, is told apart by its shape: (i + 1,) in, (i + 1, 2) out.
    def entry(i: int, out: bool) -> tuple[jax.Array, jax.Array]:
        shape = (i + 1, 2) if out else (i + 1,)
        return jnp.zeros(shape), jnp.zeros(shape)

    def layer_of(cache: Any, out: bool) -> int | None:
        leaves = jax.tree.leaves(cache)
        shapes = {tuple(getattr(x, "shape", ())) for x in leaves}
        if len(leaves) != 2 or len(shapes) != 1:
            return None
        (shape,) = shapes
        return shape[0] - 1 if len(shape) == (2 if out else 1) and shape[0] >= 1 else None

    def attend(*args, **kwargs):  # positional, as the engine's: its names are not part of the contract
        if kwargs or len(args) != 5:
            raise ProtocolError(f"{name}.__call__: attend takes (i, q, k, v, kv_cache[i]) positionally, got "
                                f"{len(args)} positional and {sorted(kwargs)} by name")  # fmt: skip
        i, q, k, v, cache = args
        calls.append(i)
        for part, x, want in (("q", q, want_q), ("k", k, want_kv), ("v", v, want_kv)):
            if tuple(x.shape) != want:
                raise ProtocolError(
                    f"{name}.__call__: attend({part}=...) got shape {tuple(x.shape)} in layer {i}; the config says "
                    f"[B, T, heads, head_dim] = {want}"
                )
        j = layer_of(cache, out=False)
        if j != i:
            given = "something else" if j is None else f"kv_cache[{j}]"
            raise ProtocolError(f"{name}.__call__: attend for layer {i} got {given}; pass it kv_cache[{i}]")
        return jnp.zeros(q.shape, q.dtype), entry(i, out=True)

    graphdef, state = nnx.split(model)

    def run(state):
        before = _leaves(state)  # now: merge shares the state's Variables, and a call that updates one updates it
        m = nnx.merge(graphdef, state)
        tokens, positions = jnp.zeros((b, t), jnp.int32), jnp.arange(t, dtype=jnp.int32)[None]
        args = (tokens, positions, [entry(i, out=False) for i in range(n)], attend)
        try:
            inspect.signature(m).bind(*args)
        except TypeError as e:  # a call that does not fit the contract's signature: say which contract
            contract = "__call__(token_ids, positions, kv_cache, attend) -> (hidden, kv_cache)"
            raise ProtocolError(f"{name}.__call__ does not take the contract's arguments ({e}): {contract}") from e
        try:
            out = m(*args)
        except ProtocolError:
            raise
        except Exception as e:  # the module's own code (its math, shapes): the error as it is, where it ran
            raise ProtocolError(f"{name}.__call__ failed on abstract inputs of {b} x {t} tokens: "
                                f"{type(e).__name__}: {str(e).rstrip('.')}") from e  # fmt: skip
        if not (isinstance(out, tuple) and len(out) == 2):
            raise ProtocolError(f"{name}.__call__: must return (hidden, kv_cache), got {type(out).__name__}")
        hidden, new_cache = out
        if not isinstance(new_cache, list | tuple) or len(new_cache) != n:
            raise ProtocolError(f"{name}.__call__: must return the kv_cache as a list of config.num_layers={n} entries")
        if sorted(calls) != list(range(n)):
            raise ProtocolError(
                f"{name}.__call__: must call attend once per layer 0..{n - 1} (config.num_layers), called it for "
                f"layers {calls}"
            )
        for i, c in enumerate(new_cache):
            if layer_of(c, out=True) != i:
                raise ProtocolError(
                    f"{name}.__call__: the returned kv_cache[{i}] is not what attend returned for layer {i}; "
                    "return each layer's new entry (the cache it was given holds none of the new tokens)"
                )
        if getattr(hidden, "ndim", None) != 3 or tuple(hidden.shape[:2]) != (b, t):
            raise ProtocolError(f"{name}.__call__: hidden must be f[B, T, D], got {getattr(hidden, 'shape', hidden)}")
        try:
            logits = m.logits(hidden[0])  # as the engine calls it: the rows it samples from, f[N, D]
        except ProtocolError:
            raise
        except Exception as e:  # re-raised as the part of the protocol it breaks, with its cause
            raise ProtocolError(
                f"{name}.logits(hidden f[N, D]) failed ({type(e).__name__}: {e}); the engine calls it on the 2-D "
                "rows it samples from"
            ) from e
        changed = _changed_paths(before, _leaves(nnx.split(m)[1]))
        if changed:
            raise ProtocolError(
                f"{name}.__call__/logits change the module's state ({', '.join(changed[:4])}): the engine runs a fixed "
                "copy of the weights, so the change is lost and every step computes something else. Dropout left "
                "on or batch norm collecting statistics does this: call model.eval() first"
            )
        return logits

    logits = jax.eval_shape(run, state)
    if tuple(logits.shape) != (t, cfg.vocab_size):
        raise ProtocolError(
            f"{name}.logits: must map f[N, D] to f32[N, vocab_size={cfg.vocab_size}], got {tuple(logits.shape)}"
        )


def _leaves(state: nnx.State) -> dict:
    return dict(jax.tree_util.tree_flatten_with_path(state)[0])


def _changed_paths(before: dict, after: dict) -> list[str]:
    """The state paths whose value a call replaced (or added, or removed): identity of the traced leaves."""
    return sorted(jax.tree_util.keystr(p) for p in before.keys() | after.keys() if before.get(p) is not after.get(p))


def is_entry_point(spec: str) -> bool:
    """`my_pkg.my_module:build`: a module path and an attribute, not a file or a preset."""
    mod, sep, attr = spec.partition(":")
    return bool(sep and mod and attr.isidentifier() and all(p.isidentifier() for p in mod.split(".")))


def load_entry_point(spec: str) -> tuple[nnx.Module, Any]:
    """Imports `pkg.module:build` and calls it: it returns a module, or (module, tokenizer). The current directory
    is searched after sys.path, as uvicorn searches it for an app: `jaxinfer serve` and `python serve.py` put their
    script's folder first, not the one the user runs them from, where `mymodels/` usually is."""
    mod, _, attr = spec.partition(":")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        build = getattr(importlib.import_module(mod), attr)
    except (ImportError, AttributeError) as e:
        raise ProtocolError(f"model: cannot load {spec!r}: {e}") from e
    out = build()
    return out if isinstance(out, tuple) else (out, None)
