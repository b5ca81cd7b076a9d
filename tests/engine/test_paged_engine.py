"""The paged engine path against the foundation's contiguous generator, on both PyPI models."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxinfer.engine.config import CacheConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.runner import compile_count
from jaxinfer.generate import generate_tokens
from jaxinfer.model_files import gemma3_270m_gguf, smollm2_gguf
from jaxinfer.types import SamplingParams
from jaxinfer.weights import load_weights

NEW = 12
# Most tests share the settings of test_paged_equals_contiguous[smollm2-8-32-8] (8 rows) or test_abort_returns_pages
# (4 rows), a 64-page pool and a 32-token step budget: the same compiled steps (SmolLM2's cost ~2 s each on the CI
# machine class), read back from the XLA cache. Those that need a small pool (preemption, eviction) have their own.
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)


def _setup(which: str):
    path = smollm2_gguf() if which == "smollm2" else gemma3_270m_gguf()
    cfg, params, _ = load_weights(path)
    rng = np.random.default_rng(0)
    # Lengths straddle page edges (page sizes 8 and 16) and one exceeds the token budget, so it is chunked.
    prompts = [rng.integers(3, 1000, n).tolist() for n in (1, 7, 16, 17, 45, 70)]
    return cfg, params, prompts, generate_tokens(params, cfg, prompts, NEW)


@pytest.fixture(scope="module")
def smol():
    """SmolLM2 alone: scheduler and cache behaviour does not depend on the family, and CI time is finite."""
    return _setup("smollm2")


@pytest.fixture(scope="module")
def model(request):
    """Both PyPI models: for the paged-vs-contiguous equality the issue asks of each (parametrized indirectly).
    SmolLM2's set is `smol`'s, loaded once for the module."""
    return request.getfixturevalue("smol") if request.param == "smollm2" else _setup(request.param)


# Gemma 3 takes one configuration: its 512-token window never binds in these 128-token sequences, and its head layout
# at page size 16 is in the kernel tests' grid (tests/kernels/test_ragged_cpu.py).
@pytest.mark.parametrize(
    "model, page_size, budget, max_seqs",
    [("smollm2", 8, 32, 8), ("smollm2", 16, 64, 4), ("gemma3", 8, 32, 8)],
    indirect=["model"],
)
def test_paged_equals_contiguous(model, page_size, budget, max_seqs):
    cfg, params, prompts, ref = model
    cc = CacheConfig(block_size=page_size, num_pages=64, max_model_len=128, max_num_seqs=max_seqs,
                     max_num_batched_tokens=budget)  # fmt: skip
    eng = Engine(cfg, params, cc)
    outs = eng.generate(prompts, GREEDY)
    assert [o[0].output_token_ids for o in outs] == ref
    assert eng.allocator.num_free == eng.allocator.num_pages


def test_a_float16_pool_keeps_the_greedy_tokens(smol, caplog, monkeypatch):
    """`--kv-cache-dtype float16` on CPU: float16 K/V, read by the numba kernel under float32 queries (no fallback
    to jnp), gives the float32 contiguous generator's greedy tokens on these prompts (chunked, straddling pages)."""
    import jax.numpy as jnp

    from kernels_pallas import dispatch

    monkeypatch.setattr(dispatch, "_warned", set())  # a decline seen before would not be logged again
    cfg, params, prompts, ref = smol
    cc = CacheConfig(block_size=16, num_pages=64, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64,
                     kv_cache_dtype="float16")  # fmt: skip
    with caplog.at_level("WARNING", logger="kernels_pallas.dispatch"):
        eng = Engine(cfg, params, cc)
        assert {x.dtype for x in jax.tree.leaves(eng.runner.kv)} == {jnp.dtype(jnp.float16)}
        outs = eng.generate(prompts, GREEDY)
    assert "declined" not in caplog.text, "the numba kernel took the float16 pool"
    assert [o[0].output_token_ids for o in outs] == ref
    assert eng.allocator.num_free == eng.allocator.num_pages


def test_preemption_keeps_outputs(smol):
    """A pool too small for all requests at once: requests are preempted and recomputed, outputs unchanged."""
    cfg, params, prompts, ref = smol
    cc = CacheConfig(block_size=8, num_pages=14, max_model_len=96, max_num_seqs=8, max_num_batched_tokens=32)
    eng = Engine(cfg, params, cc)
    outs = eng.generate(prompts, GREEDY)
    reqs = [o[0] for o in outs]
    assert [r.output_token_ids for r in reqs] == ref
    assert sum(r.num_preemptions for r in reqs) > 0
    assert eng.allocator.num_free == eng.allocator.num_pages


def test_steady_workload_compiles_nothing_after_warmup(smol):
    cfg, params, prompts, _ = smol
    cc = CacheConfig(block_size=8, num_pages=64, max_model_len=128, max_num_seqs=8, max_num_batched_tokens=32)
    eng = Engine(cfg, params, cc)
    eng.runner.warmup()
    before = compile_count()
    rng = np.random.default_rng(1)
    for _ in range(2):
        batch = [prompts[i] for i in rng.permutation(len(prompts))[:4]]
        sp = [SamplingParams(max_tokens=int(rng.integers(1, 8)), temperature=float(rng.choice([0.0, 0.8])), seed=i)
              for i in range(len(batch))]  # fmt: skip
        eng.generate(batch, sp)
    assert compile_count() == before


def test_abort_returns_pages(smol):
    cfg, params, prompts, _ = smol
    eng = Engine(cfg, params, CacheConfig(block_size=8, num_pages=64, max_model_len=128, max_num_seqs=4,
                                          max_num_batched_tokens=32))  # fmt: skip
    ids = [eng.add_request(p, GREEDY) for p in prompts]
    eng.step()
    eng.step()
    for i in ids[::2]:
        eng.abort(i)
    while eng.has_unfinished():
        eng.step()
    assert eng.allocator.num_free == eng.allocator.num_pages


def test_bad_requests_are_rejected(smol):
    cfg, params, prompts, _ = smol
    eng = Engine(cfg, params, CacheConfig(block_size=8, num_pages=8, max_model_len=128, max_num_seqs=4,
                                          max_num_batched_tokens=32))  # fmt: skip
    with pytest.raises(ValueError, match="prompt"):
        eng.add_request([], GREEDY)
    with pytest.raises(ValueError, match="maximum context"):
        eng.add_request([1] * 120, SamplingParams(max_tokens=20))
    with pytest.raises(ValueError, match="context length 64 \\(the KV pool's size\\)"):
        eng.add_request([1] * 60, SamplingParams(max_tokens=20))
    with pytest.raises(ValueError, match="token ids"):
        eng.add_request([cfg.vocab_size], GREEDY)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    assert eng.allocator.num_free == eng.allocator.num_pages


def test_logit_bias_capacity_counts_the_ids_min_tokens_bans(smol):
    """Until min_tokens the row's bias also bans the stop and EOS ids: a request is refused only when the union
    outgrows the capacity, and the error says where the entries it did not send come from."""
    cfg, params, _, _ = smol
    eng = Engine(cfg, params, CacheConfig(block_size=8, num_pages=8, max_model_len=128, max_num_seqs=4,
                                          max_num_batched_tokens=32))  # fmt: skip
    cap, stop = eng.cc.logit_bias_capacity, (7,)
    full = {t: -1.0 for t in range(100, 100 + cap)}
    eng.validate([1, 2], SamplingParams(logit_bias=full, stop_token_ids=stop))  # no min_tokens: nothing banned
    eng.validate([1, 2], SamplingParams(logit_bias={**dict(list(full.items())[1:]), 7: 1.0}, min_tokens=1,
                                        stop_token_ids=stop, ignore_eos=True))  # fmt: skip
    with pytest.raises(ValueError, match=rf"at most {cap} entries are supported, got {cap + 1} \(1 of them"):
        eng.validate([1, 2], SamplingParams(logit_bias=full, min_tokens=1, stop_token_ids=stop, ignore_eos=True))


def test_prefix_cache_prefills_only_the_suffix(smol):
    cfg, params, prompts, _ = smol
    rng = np.random.default_rng(5)
    shared = rng.integers(3, 1000, 40).tolist()
    a, b = shared + [7, 8, 9], shared + [11, 12]
    cold = Engine(cfg, params, CacheConfig(block_size=8, num_pages=64, max_model_len=128, max_num_seqs=4,
                                           max_num_batched_tokens=32, enable_prefix_caching=False))  # fmt: skip
    ref_b = cold.generate([b], GREEDY)[0][0].output_token_ids
    eng = Engine(cfg, params, CacheConfig(block_size=8, num_pages=64, max_model_len=128, max_num_seqs=4,
                                          max_num_batched_tokens=32))  # fmt: skip
    eng.generate([a], GREEDY)
    before = eng.num_prefilled_tokens
    out_b = eng.generate([b], GREEDY)[0][0].output_token_ids
    assert eng.num_prefilled_tokens - before == len(b) - 40  # 5 full pages of 8 were reused
    assert out_b == ref_b
    assert eng.allocator.hit_tokens == 40


def test_prefix_cache_eviction_under_pressure(smol):
    """Many distinct prompts through a small pool: cached pages are evicted and reused, outputs stay right."""
    cfg, params, prompts, ref = smol
    eng = Engine(cfg, params, CacheConfig(block_size=8, num_pages=20, max_model_len=96, max_num_seqs=2,
                                          max_num_batched_tokens=32))  # fmt: skip
    # Forward then backward: the backward pass starts with the most recent prompts, which survived eviction.
    order = list(range(len(prompts))) + list(range(len(prompts)))[::-1]
    for i in order:
        assert eng.generate([prompts[i]], GREEDY)[0][0].output_token_ids == ref[i]
    assert eng.allocator.num_free == eng.allocator.num_pages
    assert 0 < eng.allocator.hit_tokens
