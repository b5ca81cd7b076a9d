"""Default KV pool sizing on real meshes: under tensor parallelism a device holds its share of each page, so a
per-device budget buys tp times the pages; each data-parallel replica is sized, and placed, on its own devices.

Runs in the 8-device child pytest (tests/eight_devices.py).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.eight_devices import CHILD, child_only

if CHILD:
    import jax

    from jaxinfer.config import ModelConfig
    from jaxinfer.engine.config import CacheConfig
    from jaxinfer.engine.dp import DataParallelEngine, replica_meshes
    from jaxinfer.engine.engine import Engine
    from jaxinfer.model import init_params
    from jaxinfer.sharding import make_mesh
    from jaxinfer.weights.layout import build_on_mesh
    from tests.sharding.multihost_common import getter_for

# 2 layers x 8 KV heads x head dim 8, f32, page 8: one page (K and V) is 8 KiB on one device.
CFG = dict(arch="llama", vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8,
           num_kv_heads=8, head_dim=8, max_position_embeddings=256)  # fmt: skip
PAGE_BYTES = 2 * 2 * 8 * 8 * 8 * 4
CC = dict(block_size=8, max_model_len=96, max_num_seqs=4, max_num_batched_tokens=32)


def _replicas(dp, tp, **cache):
    cfg = ModelConfig(**CFG)
    params = jax.tree.map(np.asarray, init_params(cfg, seed=0))
    mesh = make_mesh(tp, dp)
    c, p = build_on_mesh(cfg, getter_for(cfg, params), "float32", replica_meshes(mesh)[0])
    cc = CacheConfig(**CC, **cache)
    eng = DataParallelEngine(c, p, mesh, cc) if dp > 1 else Engine(c, p, cc, mesh=mesh)
    return getattr(eng, "replicas", [eng])


def _device_bytes(runner) -> dict:
    """KV bytes each device holds for this runner's pool (every layer, K and V)."""
    out: dict = {}
    for k, v in runner.kv:
        for arr in (k, v):
            for shard in arr.addressable_shards:
                out[shard.device] = out.get(shard.device, 0) + shard.data.nbytes
    return out


@child_only
@pytest.mark.parametrize("dp, tp", [(1, 1), (1, 2), (2, 2), (4, 2), (2, 4)])
def test_budget_is_per_device_under_dp_and_tp(dp, tp):
    budget = 64 * 2**10  # 8 full pages; a device holds 1/tp of a page, so 8 * tp pages
    replicas = _replicas(dp, tp, kv_cache_memory=budget)
    seen = set()
    for e in replicas:
        assert e.runner.num_pages == 8 * tp
        per_device = _device_bytes(e.runner)
        assert len(per_device) == tp and set(per_device.values()) == {8 * tp * PAGE_BYTES // tp}
        assert max(per_device.values()) <= budget
        assert not seen & set(per_device)  # each replica's pool on its own devices
        seen |= set(per_device)


@child_only
@pytest.mark.parametrize("dp, tp", [(1, 1), (2, 4)])
def test_cpu_default_is_what_the_scheduler_addresses(dp, tp):
    pages_per_seq = -(-CC["max_model_len"] // CC["block_size"])
    want = CC["max_num_seqs"] * pages_per_seq * 5 // 4  # plus the 25% prefix-cache margin
    for e in _replicas(dp, tp):
        assert e.runner.num_pages == want
