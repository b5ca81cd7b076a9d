"""A mixed step of few sequences runs on fewer rows (`BucketTable.mixed_rows`): the same tokens as the contiguous
generator, the rarer sampling variants on the most rows, and a start that defers the fewer-row programs runs on the
most rows until they are ready, compiling nothing."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxinfer import step
from jaxinfer.config import ModelConfig
from jaxinfer.engine.config import CacheConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.runner import compile_count
from jaxinfer.generate import generate_tokens
from jaxinfer.model import init_params
from jaxinfer.types import SamplingParams

CFG = ModelConfig(arch="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, max_position_embeddings=256)  # fmt: skip
# 16 rows and one 32-token bucket: a mixed step runs on 8 rows (up to 8 sequences) or 16.
CACHE = CacheConfig(block_size=4, num_pages=96, max_model_len=64, max_num_seqs=16, max_num_batched_tokens=32)
NEW = 6
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture
def cpu_buckets(monkeypatch):
    """The CPU row of the bucket table on whatever backend runs the tests (accelerators compile no fewer rows)."""
    monkeypatch.setitem(step.BUCKET_TABLE, jax.default_backend(), step.BUCKET_TABLE["cpu"])


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, seed=0, std=0.5)


def _engine(params) -> Engine:
    return Engine(CFG, params, CACHE, eos_token_ids=(), seed=0)


def _record_mixed_rows(engine: Engine) -> list[int]:
    """The rows of every mixed step the engine runs from now on."""
    rows, bucket_for = [], engine.runner.bucket_for

    def spy(*args, **kwargs):
        decode_only, t, s = bucket_for(*args, **kwargs)
        if not decode_only:
            rows.append(s)
        return decode_only, t, s

    engine.runner.bucket_for = spy
    return rows


def test_the_fewest_rows_that_hold_the_sequences(cpu_buckets, params):
    r = _engine(params).runner
    assert r.buckets.mixed_rows(32) == (8, 16)
    assert r.bucket_for(3, 20) == (False, 32, 8)
    assert r.bucket_for(8, 32) == (False, 32, 8)
    assert r.bucket_for(9, 20) == (False, 32, 16)
    # The rarer variants are compiled for the most rows only.
    assert r.bucket_for(3, 20, advanced=True) == (False, 32, 16)
    assert r.bucket_for(3, 20, prompt_logprobs=True) == (False, 32, 16)
    assert r.bucket_for(3, 3) == (True, 8, 8)


@pytest.mark.parametrize("num_prompts", [3, 12])
def test_fewer_rows_give_the_contiguous_generators_tokens(cpu_buckets, params, num_prompts):
    rng = np.random.default_rng(num_prompts)
    prompts = [rng.integers(1, CFG.vocab_size, int(n)).tolist() for n in rng.integers(2, 20, num_prompts)]
    engine = _engine(params)
    rows = _record_mixed_rows(engine)
    outs = engine.generate(prompts, GREEDY)
    assert [o[0].output_token_ids for o in outs] == generate_tokens(params, CFG, prompts, NEW)
    assert 8 in rows and (num_prompts <= 8 or 16 in rows), rows
    assert engine.allocator.num_free == engine.allocator.num_pages


def test_a_deferred_start_runs_few_sequences_on_the_most_rows_until_the_fewer_are_ready(cpu_buckets, params):
    engine = _engine(params)
    r = engine.runner
    assert r.caches_executables  # tests run with the executable cache on (tests/conftest.py), as users do
    r.warmup(advanced=False, defer=True)
    assert r.deferred == [(False, False, False, 32, 8)]
    rows = _record_mixed_rows(engine)
    prompts = [[5, 9, 2, 33, 7], [8, 1, 40, 12, 3, 3]]  # the second shares no page with the first: no prefix hit
    before = compile_count()
    first = engine.generate(prompts[:1], GREEDY)[0][0].output_token_ids
    assert compile_count() == before and rows == [16]
    assert r.compile_deferred() == 0
    settled = compile_count()
    second = engine.generate(prompts[1:], GREEDY)[0][0].output_token_ids
    assert compile_count() == settled and rows == [16, 8]
    assert [first, second] == generate_tokens(params, CFG, prompts, NEW)
