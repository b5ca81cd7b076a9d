"""A built-in family with its layers stacked, run as one `lax.scan` over the layer axis.

The unrolled `Transformer` traces, lowers and compiles every layer again: a 30-layer step program is 30 copies of
one block. Stacked, each block parameter gains a leading layer axis and the step holds one block in a loop body.
On XLA:CPU this measured the same step time as unrolled, 5-6x less compile time and a 30x faster load of a
serialized executable (benchmarks/README.md, layer loop), which is what a warm start spends its time on. On GPU a
scan over stacked weights ran 3.2x slower (the weight slice is copied before each matmul), so the runner picks the
loop per backend (`jaxinfer.engine.runner.choose_layer_loop`).

The MLP kernels (three quarters of a block's weights) are not stacked: each stays its layer's own array, and the
loop body reads it through a `lax.switch` on the layer index (`jaxinfer.model.layers.LayerSelect`). Sliced out of a
stack, XLA:CPU copies a kernel before its matmul, every layer of every step: unrolled layers ran a batch-1 decode
step 1.16x faster than the stacked scan, and this scan runs it as fast as unrolled (benchmarks/README.md). The
attention projections stay stacked: switching over them too gained nothing measurable and doubled the matmuls a
serialized step holds (a warm start loaded its 40 steps in 4.5-5.0 s instead of 2.3-2.4 s). At one row they are
read in place all the same: XLA:CPU fuses the slice into the one-row dot (`jaxinfer.model.layers.project`), which
a switch's branch cannot do. Norm scales and biases are small and stay stacked. Gate and up become one kernel
f[2, F, D] per layer (`FUSE_GATE_UP`): one matmul where there were two; `unstacked_state` gives them back apart.

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
from jaxinfer.model.layers import LayerSelect, StackedSelect, rope_tables
from jaxinfer.model.transformer import AttentionFn, Transformer

# Gate and up as one kernel per layer (`GatedMLP.fuse_projections`). Measured on XLA:CPU (benchmarks/README.md,
# gate and up as one kernel): 1.01-1.03x a decode step of 8-128 rows, equal at one row, 1.015-1.03x a 512-token
# prefill step; q, k and v fused measured 0.97-1.03x, so they stay apart. A module constant so an A/B
# (`ab_step --variants separate_gate_up`) can build an engine without it.
FUSE_GATE_UP = True


def scan_unsupported(cfg: ModelConfig) -> str | None:
    """Why this model's layers cannot run as one scan, or None when they can."""
    if cfg.arch == CUSTOM_ARCH:
        return "a user module's layers are its own business"
    if len(set(cfg.layer_windows)) > 1:
        return "its layers differ (sliding-window and global attention alternate)"
    return None


def _whole(path: tuple) -> bool:
    """Stacked kernels that the loop body gets whole, with the layer index (`StackedSelect`), not sliced: the
    attention projections, which the CPU projection kernel reads in place (a slice handed to it is a copy)."""
    return path[-1] == "kernel" and path[0] == "attn"


def _per_layer(path: tuple) -> bool:
    """Block parameters kept as one array per layer and read in place: the MLP kernels (module docstring)."""
    return path[-1] == "kernel" and path[0] == "mlp"


class ScannedTransformer(nnx.Module):
    """A `Transformer` whose blocks are one `Block`: its parameters stacked f[L, ...], except the MLP kernels, each
    a tuple of the L layers' arrays. Same weights, same outputs; `__call__` takes the KV cache of all layers as one
    object (see the module docstring)."""

    def __init__(self, model: Transformer, donate: bool = False):
        """Stacks `model`'s block parameters (copies, freed with the caller's model), except the MLP kernels (kept;
        gate and up fused into one, a copy, under `FUSE_GATE_UP`). `donate`: the caller gives up `model`'s block
        arrays, and each one copied is deleted here, so the copies do not double the weights' memory until the
        caller lets go (the engine's own loaded weights, whose KV pool is allocated next)."""
        reason = scan_unsupported(model.config)
        if reason is not None:
            raise ValueError(f"layer_loop='scan': this model cannot scan its layers: {reason}")
        self.config = model.config
        self.embedder, self.final_norm, self.lm_head = model.embedder, model.final_norm, model.lm_head
        blocks = list(model.layers)
        if FUSE_GATE_UP:
            blocks = [nnx.clone(block) for block in blocks]  # the caller's model keeps its own layout
            for block in blocks:
                block.mlp.fuse_projections()
        graphdef = nnx.graphdef(blocks[0])
        flat = []
        for entries in zip(*(nnx.to_flat_state(nnx.state(block)) for block in blocks), strict=True):
            path, first = entries[0]
            values = tuple(v.get_value() for _, v in entries)
            flat.append((path, first.replace(values if _per_layer(path) else jnp.stack(values))))
        self.layers = nnx.merge(graphdef, nnx.from_flat_state(flat))
        if donate:
            kept = {id(x) for x in jax.tree.leaves(nnx.state(self.layers))}
            for x in jax.tree.leaves(nnx.state(model.layers)):
                if id(x) not in kept:
                    x.delete()

    def __call__(self, tokens: jax.Array, positions: jax.Array, kv_cache: Any, attend: AttentionFn):
        """tokens, positions i32[B, T]; `attend(layer i32[], q, k, v, kv_cache) -> (out, kv_cache)`.
        Returns the final-normed hidden states f[B, T, D] and the cache."""
        cfg = self.config
        x = self.embedder(tokens)
        table = rope_tables(cfg.rope_local if cfg.layer_windows[0] and cfg.rope_local else cfg.rope, cfg.head_dim,
                            positions)  # fmt: skip
        ropes = {"global": table, "local": table}  # every layer uses the same one (scan_unsupported)
        graphdef, state = nnx.split(self.layers)
        flat = list(nnx.to_flat_state(state))
        stacked = nnx.from_flat_state([(path, v) for path, v in flat if not _per_layer(path) and not _whole(path)])
        kernels = [(path, v) for path, v in flat if _per_layer(path)]
        whole = [(path, v) for path, v in flat if _whole(path)]

        def body(carry: tuple, layer_state: nnx.State) -> tuple[tuple, None]:
            x, cache, i = carry
            # The block's own index is layer 0's (its graphdef): attend gets the traced one instead.
            at_layer = lambda _, q, k, v, c: attend(i, q, k, v, c)  # noqa: E731
            picked = [(path, v.replace(LayerSelect(v.get_value(), i))) for path, v in kernels]
            picked += [(path, v.replace(StackedSelect(v.get_value(), i))) for path, v in whole]
            layer_state = nnx.from_flat_state(list(nnx.to_flat_state(layer_state)) + picked)
            x, cache = nnx.merge(graphdef, layer_state)(x, ropes, at_layer, cache)
            return (x, cache, i + 1), None

        (x, kv_cache, _), _ = jax.lax.scan(body, (x, kv_cache, jnp.int32(0)), stacked)
        return self.final_norm(x), kv_cache

    logits = Transformer.logits

    def unstacked_state(self) -> nnx.State:
        """The weights in the family's own layout (`Transformer`'s state; the stacked parameters' slices are
        copies), for the reference paths that run the unrolled model on a contiguous cache."""
        flat = [(path, v) for path, v in nnx.to_flat_state(nnx.state(self)) if path[0] != "layers"]
        graphdef, state = nnx.split(self.layers)
        layers = list(nnx.to_flat_state(state))
        for i in range(self.config.num_layers):
            # Layer i's slice of each stacked array, or its own kernel out of a tuple.
            block = nnx.merge(graphdef, nnx.from_flat_state([(p, v.replace(v.get_value()[i])) for p, v in layers]))
            if block.mlp.gate_up is not None:
                block.mlp.unfuse_projections()
            flat += [(("layers", i, *path), v) for path, v in nnx.to_flat_state(nnx.state(block))]
        return nnx.from_flat_state(flat)
