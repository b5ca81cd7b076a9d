"""A step's host inputs travel to the device as two flat buffers (int32 and float32), not ~25 small arrays.

Each host->device copy has a fixed cost (a transfer on GPU/TPU, a sharding lookup and a buffer in jax), and the
jitted step pays per argument too; a step's inputs (StepInputs + SamplingTensors) are a few KB in ~25 leaves.
`to_flat` packs them into one int32 and one float32 array (uint32 seeds are bit-cast, bools become 0/1) and
returns the static `Layout` that `from_flat`, inside the jitted step, uses to slice the leaves back out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

_INT, _FLOAT = 0, 1


@dataclass(frozen=True)
class Layout:
    """Where each leaf sits in the flat buffers: hashable, a static argument of the jitted step."""

    treedef: Any
    leaves: tuple[tuple[int, int, tuple[int, ...], str], ...]  # (buffer, offset, shape, dtype name)


# dtype.str ('<f4', ...) -> (buffer, dtype name). Comparing dtypes and reading `dtype.name` run Python code: with
# them, packing a step's ~25 leaves took 170 us of the host's time a step (30 us with this table).
_KINDS = {np.dtype(t).str: (buf, np.dtype(t).name)
          for t, buf in ((np.float32, _FLOAT), (np.int32, _INT), (np.uint32, _INT), (np.bool_, _INT))}  # fmt: skip


def to_flat(tree: Any) -> tuple[tuple[np.ndarray, np.ndarray], Layout]:
    """Host side: a pytree of numpy arrays (int32, uint32, bool, float32) -> ((int32[n], float32[m]), layout)."""
    leaves, treedef = jax.tree.flatten(tree)
    parts: tuple[list[np.ndarray], list[np.ndarray]] = ([], [])
    sizes = [0, 0]
    spec = []
    for leaf in leaves:
        a = np.asarray(leaf)
        kind = _KINDS.get(a.dtype.str)
        if kind is None:
            raise TypeError(f"to_flat: unsupported dtype {a.dtype}")
        buf, name = kind
        flat = a.reshape(-1)
        if name == "bool":
            flat = flat.astype(np.int32)
        elif name == "uint32":
            flat = flat.view(np.int32)  # seeds keep their bits
        spec.append((buf, sizes[buf], a.shape, name))
        sizes[buf] += flat.size
        parts[buf].append(flat)
    ints = np.concatenate(parts[_INT]) if parts[_INT] else np.zeros(0, np.int32)
    floats = np.concatenate(parts[_FLOAT]) if parts[_FLOAT] else np.zeros(0, np.float32)
    return (ints, floats), Layout(treedef, tuple(spec))


def from_flat(buffers: tuple[jax.Array, jax.Array], layout: Layout) -> Any:
    """Device side (inside jit): the pytree `to_flat` packed, with its original dtypes."""
    leaves = []
    for buf, offset, shape, dtype in layout.leaves:
        size = int(np.prod(shape, dtype=np.int64))
        x = lax.slice(buffers[buf], (offset,), (offset + size,)).reshape(shape)
        if dtype == "uint32":
            x = lax.bitcast_convert_type(x, jnp.uint32)
        elif dtype == "bool":
            x = x != 0
        leaves.append(x)
    return jax.tree.unflatten(layout.treedef, leaves)
