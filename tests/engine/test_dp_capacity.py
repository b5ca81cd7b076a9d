"""Data-parallel replicas with unequal KV pools (unequal free memory): each validates against its own capacity, a
request too large for one replica goes to the other, and one that fits no replica is a ValueError naming
max_tokens (a 400 on the server), never a request that waits forever.

Runs in the 8-device child pytest (tests/eight_devices.py)."""

from __future__ import annotations

import pytest

from tests.eight_devices import child_only


@child_only
def test_unequal_replicas_route_by_capacity(monkeypatch):
    import jax

    from jaxinfer.config import ModelConfig
    from jaxinfer.engine import runner
    from jaxinfer.engine.config import CacheConfig
    from jaxinfer.engine.dp import DataParallelEngine, replica_meshes
    from jaxinfer.engine.runner import kv_bytes_per_token
    from jaxinfer.model import init_params
    from jaxinfer.sharding import make_mesh
    from jaxinfer.types import SamplingParams

    assert jax.device_count() == 8
    cfg = ModelConfig(arch="llama", vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8,
                      num_kv_heads=8, head_dim=8, max_position_embeddings=256)  # fmt: skip
    cc = CacheConfig(block_size=8, max_model_len=200, max_num_seqs=4, max_num_batched_tokens=32,
                     gpu_memory_utilization=0.5)  # fmt: skip
    page_bytes = kv_bytes_per_token(cfg) * cc.block_size
    free = iter([2 * 6 * page_bytes, 2 * 24 * page_bytes])  # replica 0: 6 pages (48 tokens), replica 1: 24 (192)
    monkeypatch.setattr(runner, "_free_bytes", lambda devices: [next(free)] * len(devices))
    mesh = make_mesh(1, 2)
    params = jax.device_put(
        init_params(cfg, seed=0), jax.sharding.NamedSharding(replica_meshes(mesh)[0], jax.sharding.PartitionSpec())
    )
    eng = DataParallelEngine(cfg, params, mesh, cc, eos_token_ids=())
    assert [e.allocator.num_pages for e in eng.replicas] == [6, 24]
    sp = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    small, large = eng.add_request([1, 2, 3], sp), eng.add_request(list(range(1, 90)) + [5] * 60, sp)
    assert eng._owner[large] is eng.replicas[1]  # 169 tokens: only replica 1 holds them, whatever the load
    # A request that fits no replica: a clear error (the largest replica's), nothing queued.
    with pytest.raises(ValueError, match="^max_tokens: .*pool holds 192"):
        eng.add_request([1] * 150, SamplingParams(max_tokens=45))
    done = {}
    while eng.has_unfinished():
        for u in eng.step():
            done.setdefault(u.request_id, []).extend(u.new_token_ids)
    assert len(done[small]) == len(done[large]) == 20
    assert all(e.allocator.num_free == e.allocator.num_pages for e in eng.replicas)
