"""A module split once into a static definition and a flat list of weight arrays, for jitted steps.

`nnx.jit` re-splits the module on every call (12-15 ms of Python per call in the earlier study). Instead the
engine splits once: `ModelDef` (graphdef + the state's pytree structure) is a static argument hashed by identity
(O(1) per call), and the weights travel as a plain list of arrays, which jit flattens in C++ as fast as the old
dict of arrays. Inside the jitted function `ModelDef.merge(leaves)` rebuilds the module at trace time only.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
from flax import nnx

from jaxinfer.config import ModelConfig


class ModelDef:
    """The static half of a split model. Equality and hash are by identity (O(1) per call); `split_model` returns
    the same ModelDef for equal (graphdef, treedef), so splitting again reuses the compiled programs."""

    def __init__(self, graphdef: nnx.GraphDef, treedef: Any):
        self.graphdef, self.treedef = graphdef, treedef

    def __repr__(self) -> str:
        # Stable across processes (no object ids): the executable cache keys compiled steps by it.
        return f"ModelDef({self.graphdef!r}, {self.treedef!r})"

    def merge(self, leaves: list[jax.Array]) -> nnx.Module:
        return nnx.merge(self.graphdef, jax.tree.unflatten(self.treedef, leaves))

    def state(self, leaves: list[jax.Array]) -> nnx.State:
        return jax.tree.unflatten(self.treedef, leaves)


def split_model(cfg: ModelConfig, model: nnx.Module | nnx.State) -> tuple[ModelDef, list[jax.Array]]:
    """(ModelDef, weight leaves) of a module, or of a built-in family's state (its graphdef from the config)."""
    if isinstance(model, nnx.Module):
        graphdef, state = nnx.split(model)
    else:
        from jaxinfer.model.transformer import abstract_model

        graphdef, state = abstract_model(cfg)[0], model
    leaves, treedef = jax.tree.flatten(state)
    return _model_def(graphdef, treedef), leaves


@functools.lru_cache(maxsize=64)
def _model_def(graphdef: nnx.GraphDef, treedef: Any) -> ModelDef:
    return ModelDef(graphdef, treedef)
