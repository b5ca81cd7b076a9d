"""Meshes and the logical-axis rules that place parameters and KV pools on them.

Model code names logical axes (`jaxinfer.model.param_axes`); this table maps them to mesh axes. Tensor parallelism
splits attention heads, the MLP hidden dimension and the vocabulary over `model` (Megatron style: XLA inserts the
all-reduces after `o` and `down` and the gather of the logits); the KV pools split by KV head. `data` holds
independent replicas (see `jaxinfer.engine.dp`).

Where a model has fewer KV heads than the tensor-parallel size (SmolLM2 has 3, Gemma 3 270M has 1), each KV head is
replicated so that every `model` shard holds one copy of the head its query heads read, as vLLM does: the math is
unchanged (GQA over repeated heads), and the KV cache per device is one head.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jaxinfer.config import ModelConfig

DATA, MODEL = "data", "model"

# logical axis -> mesh axis (None: replicated)
RULES: dict[str, str | None] = {
    "vocab": MODEL,
    "embed": None,
    "q_heads": MODEL,
    "kv_heads": MODEL,
    "head_dim": None,
    "mlp": MODEL,
    "norm": None,
    # KV pools
    "pages": None,
    "page_slot": None,
}
KV_POOL_AXES = ("pages", "page_slot", "kv_heads", "head_dim")


class ShardingError(ValueError):
    """A mesh that cannot run this model (a dimension that does not split, too few devices)."""


def make_mesh(tensor_parallel_size: int = 1, data_parallel_size: int = 1, devices: list | None = None) -> Mesh:
    """A ("data", "model") mesh over the first dp * tp devices (extra devices stay idle)."""
    tp, dp = tensor_parallel_size, data_parallel_size
    if tp < 1 or dp < 1:
        raise ShardingError(f"tensor_parallel_size and data_parallel_size must be >= 1, got {tp} and {dp}")
    devices = list(devices if devices is not None else jax.devices())
    if len(devices) < tp * dp:
        raise ShardingError(
            f"the mesh needs tensor_parallel_size * data_parallel_size = {tp} * {dp} = {tp * dp} devices, "
            f"but only {len(devices)} are available ({jax.default_backend()})"
        )
    # NOTE: Auto axes: the model is written GSPMD-style and XLA propagates shardings from the parameters.
    return jax.make_mesh((dp, tp), (DATA, MODEL), axis_types=(AxisType.Auto, AxisType.Auto),
                         devices=devices[: tp * dp])  # fmt: skip


def kv_replication(cfg: ModelConfig, tp: int) -> int:
    """How many copies of each KV head the tensor-parallel split needs (1: none)."""
    return tp // cfg.num_kv_heads if cfg.num_kv_heads < tp else 1


def check_tensor_parallel(cfg: ModelConfig, tp: int) -> None:
    """Raises ShardingError naming the first dimension that cannot be split tp ways. Call before loading."""
    checks = [
        ("num_heads (attention heads)", cfg.num_heads),
        ("intermediate_size (MLP hidden dimension)", cfg.intermediate_size),
        ("vocab_size", cfg.vocab_size),
    ]
    for name, size in checks:
        if size % tp:
            raise ShardingError(f"tensor_parallel_size={tp} does not divide {name}={size}")
    kv = cfg.num_kv_heads
    if kv >= tp and kv % tp:
        raise ShardingError(f"tensor_parallel_size={tp} does not divide num_kv_heads={kv}")
    if kv < tp and tp % kv:
        raise ShardingError(
            f"num_kv_heads={kv} is smaller than tensor_parallel_size={tp} and does not divide it, so KV heads "
            "cannot be replicated evenly"
        )


def sharded_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The config the sharded model runs with: KV heads replicated up to tp where there are fewer."""
    check_tensor_parallel(cfg, tp)
    r = kv_replication(cfg, tp)
    return cfg if r == 1 else dataclasses.replace(cfg, num_kv_heads=cfg.num_kv_heads * r)


def spec(axes: tuple[str, ...], mesh: Mesh) -> PartitionSpec:
    """PartitionSpec for logical axes; a mesh axis of size 1 is left out (nothing to split)."""
    out = []
    for a in axes:
        m = RULES.get(a)
        out.append(m if m is not None and mesh.shape[m] > 1 else None)
    return PartitionSpec(*out)


def placer(cfg: ModelConfig, mesh: Mesh, dtype: str):
    """A weights Placer: each leaf, in our layout on the host, is put on the mesh shard by shard (device_put
    from numpy sends every device only its slice), with KV heads replicated first where needed."""
    check_tensor_parallel(cfg, mesh.shape[MODEL])
    r = kv_replication(cfg, mesh.shape[MODEL])

    def place(path: str, x: np.ndarray, axes: tuple[str, ...]) -> jax.Array:
        if r > 1 and "kv_heads" in axes:
            # Head j of the replicated layout is original head j // r: consecutive copies, matching GQA's
            # grouping of query heads (query head h reads KV head h // group).
            x = np.repeat(x, r, axis=axes.index("kv_heads"))
        return jax.device_put(x.astype(dtype), NamedSharding(mesh, spec(axes, mesh)))

    return place


def tree_shardings(axes_tree: Any, mesh: Mesh) -> Any:
    """NamedShardings for a pytree whose leaves are tuples of logical axis names."""
    is_axes = lambda x: isinstance(x, tuple) and all(isinstance(a, str) for a in x)  # noqa: E731
    return jax.tree.map(lambda a: NamedSharding(mesh, spec(a, mesh)), axes_tree, is_leaf=is_axes)


def replicate_kv_params(cfg: ModelConfig, params: Any, mesh: Mesh) -> tuple[ModelConfig, Any]:
    """Reshards already-loaded params (e.g. restored from a checkpoint) onto the mesh, replicating KV heads."""
    from jaxinfer.model.transformer import param_axes

    new_cfg = sharded_config(cfg, mesh.shape[MODEL])
    place = placer(cfg, mesh, cfg.dtype)
    axes = param_axes(cfg)
    is_axes = lambda x: isinstance(x, tuple) and all(isinstance(a, str) for a in x)  # noqa: E731
    leaves_axes = jax.tree.leaves(axes, is_leaf=is_axes)
    leaves, treedef = jax.tree.flatten(params)
    placed = [place("", np.asarray(x), a) for x, a in zip(leaves, leaves_axes, strict=True)]
    return new_cfg, jax.tree.unflatten(treedef, placed)
