"""A built-in family with its layers stacked, run as one `lax.scan` over the layer axis.

The unrolled `Transformer` traces, lowers and compiles every layer again: a 30-layer step program is 30 copies of
one block. Stacked, each block parameter gains a leading layer axis and the step holds one block in a loop body.
On XLA:CPU this measured the same step time as unrolled, 5-6x less compile time and a 30x faster load of a
serialized executable (benchmarks/README.md, layer loop), which is what a warm start spends its time on. On GPU a
scan over stacked weights ran 3.2x slower (the weight slice is copied before each matmul), so the runner picks the
loop per backend (`jaxinfer.engine.runner.choose_layer_loop`).

The KV cache is one object for all layers, carried through the loop: `attend` receives the layer index as a
traced int32 and the whole cache, and returns the whole cache (the engine writes the layer's K/V in place into
pools stacked over layers). Only families whose layers all have the same attention (window, RoPE table) scan:
the loop body is one block's code.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxinfer.config import CUSTOM_ARCH, ModelConfig
from jaxinfer.model.layers import rope_tables
from jaxinfer.model.transformer import AttentionFn, Transformer


def scan_unsupported(cfg: ModelConfig) -> str | None:
    """Why this model's layers cannot run as one scan, or None when they can."""
    if cfg.arch == CUSTOM_ARCH:
        return "a user module's layers are its own business"
    if len(set(cfg.layer_windows)) > 1:
        return "its layers differ (sliding-window and global attention alternate)"
    return None


class ScannedTransformer(nnx.Module):
    """A `Transformer` whose blocks are one `Block` holding stacked parameters f[L, ...]. Same weights, same
    outputs; `__call__` takes the KV cache of all layers as one object (see the module docstring)."""

    def __init__(self, model: Transformer):
        """Stacks `model`'s block parameters (copies: the per-layer arrays are freed once the caller drops them)."""
        reason = scan_unsupported(model.config)
        if reason is not None:
            raise ValueError(f"layer_loop='scan': this model cannot scan its layers: {reason}")
        self.config = model.config
        self.embedder, self.final_norm, self.lm_head = model.embedder, model.final_norm, model.lm_head
        graphdef = nnx.graphdef(model.layers[0])
        states = [nnx.state(block) for block in model.layers]
        self.layers = nnx.merge(graphdef, jax.tree.map(lambda *xs: jnp.stack(xs), *states))

    def __call__(self, tokens: jax.Array, positions: jax.Array, kv_cache: Any, attend: AttentionFn):
        """tokens, positions i32[B, T]; `attend(layer i32[], q, k, v, kv_cache) -> (out, kv_cache)`.
        Returns the final-normed hidden states f[B, T, D] and the cache."""
        cfg = self.config
        x = self.embedder(tokens)
        table = rope_tables(cfg.rope_local if cfg.layer_windows[0] and cfg.rope_local else cfg.rope, cfg.head_dim,
                            positions)  # fmt: skip
        ropes = {"global": table, "local": table}  # every layer uses the same one (scan_unsupported)
        graphdef, stacked = nnx.split(self.layers)

        def body(carry: tuple, layer_state: nnx.State) -> tuple[tuple, None]:
            x, cache, i = carry
            # The block's own index is layer 0's (its graphdef): attend gets the traced one instead.
            at_layer = lambda _, q, k, v, c: attend(i, q, k, v, c)  # noqa: E731
            x, cache = nnx.merge(graphdef, layer_state)(x, ropes, at_layer, cache)
            return (x, cache, i + 1), None

        (x, kv_cache, _), _ = jax.lax.scan(body, (x, kv_cache, jnp.int32(0)), stacked)
        return self.final_norm(x), kv_cache

    logits = Transformer.logits

    def unstacked_state(self) -> nnx.State:
        """The weights in the family's own layout (`Transformer`'s state; the layer slices are copies), for the
        reference paths that run the unrolled model on a contiguous cache."""
        flat = [(path, v) for path, v in nnx.to_flat_state(nnx.state(self)) if path[0] != "layers"]
        for path, v in nnx.to_flat_state(nnx.state(self.layers)):
            flat += [(("layers", i, *path), v.replace(v[...][i])) for i in range(self.config.num_layers)]
        return nnx.from_flat_state(flat)
