"""Meshes and the logical-axis rules that place parameters and KV pools on them.

Model code names logical axes (each Param's Flax `out_sharding` metadata); `RULES`, a MaxText-style rules table,
maps them to mesh axes through Flax's partitioning utilities (`get_var_pspec`, `logical_to_mesh_axes`). Tensor
parallelism splits attention heads, the MLP hidden dimension and the vocabulary over `model` (Megatron style: XLA
inserts the all-reduces after `o` and `down` and the gather of the logits); the KV pools split by KV head. `data`
holds independent replicas (see `jaxinfer.engine.dp`).

Where a model has fewer KV heads than the tensor-parallel size (SmolLM2 has 3, Gemma 3 270M has 1), each KV head is
replicated so that every `model` shard holds one copy of the head its query heads read, as vLLM does: the math is
unchanged (GQA over repeated heads), and the KV cache per device is one head.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.linen import logical_to_mesh_axes
from flax.nnx.spmd import get_var_pspec
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jaxinfer.config import ModelConfig

DATA, MODEL = "data", "model"

# (logical axis, mesh axis); a logical axis not listed is replicated.
RULES: tuple[tuple[str, str | None], ...] = (
    ("vocab", MODEL),
    ("q_heads", MODEL),
    ("kv_heads", MODEL),
    ("mlp", MODEL),
    ("embed", None),
    ("head_dim", None),
    ("norm", None),
    ("fused", None),  # the pair axis of a fused gate/up kernel (layers.GatedMLP)
    # KV pools
    ("pages", None),
    ("page_slot", None),
)
KV_POOL_AXES = ("pages", "page_slot", "kv_heads")  # [pages, page_size, Hkv * Dh]: split by whole heads


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


def mesh_rules(mesh: Mesh) -> tuple[tuple[str, str | None], ...]:
    """RULES on this mesh: a mesh axis of size 1 is left out (nothing to split, and one spec per placement)."""
    return tuple((logical, m if m is not None and mesh.shape[m] > 1 else None) for logical, m in RULES)


def spec(axes: tuple[str | None, ...], mesh: Mesh) -> PartitionSpec:
    """PartitionSpec of mesh axes for logical axes."""
    return logical_to_mesh_axes(tuple(axes), mesh_rules(mesh))


def var_axes(v: nnx.Variable) -> tuple[str | None, ...]:
    """A parameter's logical axis names, from its Flax sharding metadata (unnamed: replicated)."""
    return tuple(get_var_pspec(v) or PartitionSpec(*([None] * len(v.shape))))


def placer(cfg: ModelConfig, mesh: Mesh, dtype: str):
    """A weights Placer: each leaf, in our layout on the host, is put on the mesh shard by shard (device_put
    from numpy sends every device only its slice), with KV heads replicated first where needed."""
    check_tensor_parallel(cfg, mesh.shape[MODEL])
    r = kv_replication(cfg, mesh.shape[MODEL])

    def place(path, x: np.ndarray, axes: tuple[str, ...]) -> jax.Array:
        if r > 1 and "kv_heads" in axes:
            # Head j of the replicated layout is original head j // r: consecutive copies, matching GQA's
            # grouping of query heads (query head h reads KV head h // group).
            x = np.repeat(x, r, axis=axes.index("kv_heads"))
        return jax.device_put(x.astype(dtype), NamedSharding(mesh, spec(axes, mesh)))

    return place


_LOGICAL_AXES = frozenset(name for name, _ in RULES)


def _known_axes(path: tuple, v: nnx.Variable) -> tuple[str | None, ...]:
    """`var_axes(v)`, each a name of RULES: a misspelt one ("q_head") would leave the weight replicated, silently."""
    axes = var_axes(v)
    unknown = [a for a in axes if isinstance(a, str) and a not in _LOGICAL_AXES]
    if unknown:
        where = ".".join(str(p) for p in path)
        raise ShardingError(f"{where}: logical axis {unknown[0]!r} is none of {sorted(_LOGICAL_AXES)}")
    return axes


def state_shardings(state: nnx.State, mesh: Mesh) -> nnx.State:
    """NamedShardings for every parameter of a (possibly abstract) nnx state, from its logical axis metadata. A
    plain array attribute of a module (a table it built, say) has no metadata: replicated."""

    def sharding(path, v):
        if isinstance(v, nnx.Variable):
            return v.replace(NamedSharding(mesh, spec(_known_axes(path, v), mesh)))
        return NamedSharding(mesh, PartitionSpec())

    return nnx.map_state(sharding, state)


def place_state(cfg: ModelConfig, state: nnx.State, mesh: Mesh) -> tuple[ModelConfig, nnx.State]:
    """Reshards an already-loaded state (e.g. restored from a checkpoint) onto the mesh, replicating KV heads."""
    new_cfg = sharded_config(cfg, mesh.shape[MODEL])
    place = placer(cfg, mesh, cfg.dtype)
    placed = nnx.map_state(lambda path, v: v.replace(place(path, np.asarray(v[...]), var_axes(v))), state)
    return new_cfg, placed


def place_module(cfg: ModelConfig, module: nnx.Module, mesh: Mesh) -> nnx.Module:
    """A user module (jaxinfer.model.protocol) with its weights placed on the mesh from their logical axes.

    Its heads must split tp ways: attention runs per shard on its query and KV heads, and the KV pools split by KV
    head (replicated only for the built-in families). Other sizes matter only where a parameter names a sharded
    axis, and each is checked as it is placed: a replicated vocabulary may be odd."""
    tp = mesh.shape[MODEL]
    for name, size in (("num_heads (attention heads)", cfg.num_heads), ("num_kv_heads", cfg.num_kv_heads)):
        if size % tp:
            more = ": KV-head replication is only done for the built-in families" if size < tp else ""
            raise ShardingError(f"tensor_parallel_size={tp} does not divide {name}={size}{more}")
    graphdef, state = nnx.split(module)

    def place(path, leaf, sharding):
        try:
            placed = jax.device_put(leaf, sharding)
        except ValueError as e:  # jax's IndivisibleError: a dimension the mesh does not divide
            raise ShardingError(f"{jax.tree_util.keystr(path, simple=True, separator='.')}: {e}") from None
        # A copy, never the caller's buffer: a replicated leaf's shard on the caller's device is the module's own
        # array (device_put's may_alias=False does not stop that), and donating it in the caller's training step
        # would delete one shard of the engine's weights, which PjRt answers with a segfault at the next step.
        if device_buffers(placed) & device_buffers(leaf):
            placed = jax.device_put(jnp.copy(leaf), sharding)
        return placed

    return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(place, state, state_shardings(state, mesh)))


def device_buffers(tree: object) -> frozenset[int]:
    """The device buffers under the jax arrays of `tree` (a pytree or a module), by address: what two trees share."""
    leaves = jax.tree.leaves(nnx.state(tree) if isinstance(tree, nnx.Module) else tree)
    return frozenset(
        shard.data.unsafe_buffer_pointer()
        for x in leaves
        if isinstance(x, jax.Array) and not x.is_deleted()
        for shard in x.addressable_shards
    )
