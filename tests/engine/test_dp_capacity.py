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
    assert [e.cc.max_model_len for e in eng.replicas] == [48, 192] and eng.cc.max_model_len == 192  # pool-bound
    sp = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    prompts = [list(range(1, 12)), list(range(1, 90)) + [5] * 60]
    small, large = (eng.add_request(p, sp) for p in prompts)
    assert eng._owner[small] is eng.replicas[0]  # the least loaded then
    assert eng._owner[large] is eng.replicas[1]  # 169 tokens: only replica 1 holds them, whatever the load
    # A request that fits no replica: a clear error (the largest replica's), nothing queued.
    with pytest.raises(ValueError, match="^max_tokens: .*context length 192 \\(the KV pool's size\\)"):
        eng.add_request([1] * 150, SamplingParams(max_tokens=45))
    done = {}
    while eng.has_unfinished():
        for u in eng.step():
            done.setdefault(u.request_id, []).extend(u.new_token_ids)
    assert len(done[small]) == len(done[large]) == 20
    assert all(e.allocator.num_free == e.allocator.num_pages for e in eng.replicas)

    # Each replica keeps its prompt's full pages in its prefix cache, until reset_prefix_cache drops them on all.
    def cached() -> list[int]:
        found = []
        for e, p in zip(eng.replicas, prompts, strict=True):
            pages, _ = e.allocator.match_prefix(p, 64)
            e.allocator.free(pages)  # match_prefix took a reference on each
            found.append(len(pages))
        return found

    assert cached() == [1, 18]
    eng.reset_prefix_cache()
    assert cached() == [0, 0]


@child_only
def test_dp_front_in_process_server_weights_and_hashed_ids(tmp_path):
    """Two replicas behind one front: the in-process server starts on it (it read a runner the front has not),
    update_weights takes a module on every replica or on none, and a request id holding '#' is found again when
    the output loop ends it (a stop string) rather than taken for a sample of an n > 1 request."""

    import jax

    from jaxinfer import LLM, SamplingParams
    from jaxinfer.model.transformer import merge
    from jaxinfer.weights import load_weights
    from tests.server.conftest import in_process
    from tests.tiny_model import SETTINGS, write_tiny_model

    write_tiny_model(tmp_path)
    g = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    llm = LLM(str(tmp_path), data_parallel_size=2, **SETTINGS)
    eng = llm.engine
    rid = eng.add_request([1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True), "a#b")
    eng.step()
    eng.finish_sequence(rid, "stop", "x")
    for _ in range(3):
        eng.step()
    assert not eng.has_unfinished() and eng.allocator.num_free == eng.allocator.num_pages

    before = [o.outputs[0].token_ids for o in llm.generate(["Hello", "Hello"], g, use_tqdm=False)]
    cfg, state, _ = load_weights(tmp_path)
    llm.update_weights(merge(cfg, jax.tree.map(lambda x: x * 1.5, state)))
    after = [o.outputs[0].token_ids for o in llm.generate(["Hello", "Hello"], g, use_tqdm=False)]
    assert before[0] == before[1] and after[0] == after[1] != before[0]

    with in_process(eng, llm.tokenizer) as client:
        body = {"prompt": "Hello", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 6
    llm.close()
