"""The per-backend bucket table (jaxinfer.step.bucket_table)."""

from __future__ import annotations

import pytest

from jaxinfer.step import bucket_table, pick_bucket


def test_cpu_decodes_a_single_stream_at_batch_one():
    b = bucket_table("cpu", max_num_seqs=32, max_num_batched_tokens=256)
    assert b.seq_buckets == (1, 8, 16, 32)
    assert b.token_buckets == (32, 64, 128, 256)


@pytest.mark.parametrize("backend", ["gpu", "tpu", "rocm"])
def test_accelerators_start_at_eight_rows(backend):
    assert bucket_table(backend, max_num_seqs=32, max_num_batched_tokens=256).seq_buckets == (8, 16, 32)


@pytest.mark.parametrize("backend", ["cpu", "gpu"])
@pytest.mark.parametrize("max_seqs, max_tokens", [(1, 32), (4, 16), (3, 40), (48, 300)])
def test_every_batch_fits_a_bucket_and_the_limits_are_buckets(backend, max_seqs, max_tokens):
    b = bucket_table(backend, max_seqs, max_tokens)
    assert b.seq_buckets[-1] == max_seqs and b.token_buckets[-1] == max_tokens
    assert list(b.seq_buckets) == sorted(set(b.seq_buckets))
    assert all(pick_bucket(n, b.seq_buckets) >= n for n in range(1, max_seqs + 1))


@pytest.mark.parametrize(
    "seqs,tokens,backend,expected",
    [
        (None, None, "cpu", (128, 512)),  # the CPU defaults
        (None, None, "gpu", (32, 256)),
        (None, None, "tpu", (32, 256)),
        (None, None, "rocm-or-other", (32, 256)),  # an unknown backend: the GPU row
        (8, None, "cpu", (8, 512)),  # a given value wins, the other stays the backend's
        (None, 256, "cpu", (128, 256)),
        (None, 64, "cpu", (64, 64)),  # the default max_num_seqs shrinks to a given budget
        (1024, None, "gpu", (1024, 1024)),  # every decode needs a token slot: the budget grows to max_num_seqs
        (4, 16, "gpu", (4, 16)),
    ],
)
def test_batch_limits_default_per_backend(seqs, tokens, backend, expected):
    from jaxinfer.engine.config import batch_limits

    assert batch_limits(seqs, tokens, backend) == expected


def test_plain_engine_args_take_the_backends_batch_limits():
    import jax

    from jaxinfer.config import ModelConfig
    from jaxinfer.engine.build import cache_config
    from jaxinfer.engine.config import BATCH_DEFAULTS, EngineArgs

    cfg = ModelConfig(arch="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=16)  # fmt: skip
    cc = cache_config(EngineArgs(), cfg)
    assert (cc.max_num_seqs, cc.max_num_batched_tokens) == BATCH_DEFAULTS[jax.default_backend()]
    cc = cache_config(EngineArgs(max_num_seqs=3, max_num_batched_tokens=40), cfg)
    assert (cc.max_num_seqs, cc.max_num_batched_tokens) == (3, 40)


@pytest.mark.parametrize("max_seqs, max_tokens", [(128, 512), (16, 32), (4, 16), (3, 40)])
def test_mixed_steps_take_fewer_rows_on_cpu_only_and_never_more_than_tokens(max_seqs, max_tokens):
    cpu, gpu = bucket_table("cpu", max_seqs, max_tokens), bucket_table("gpu", max_seqs, max_tokens)
    assert cpu.mixed_seq_buckets == ((8, max_seqs) if max_seqs > 8 else (max_seqs,))
    assert gpu.mixed_seq_buckets == (max_seqs,)
    for b in (cpu, gpu):
        for t in b.token_buckets:
            rows = b.mixed_rows(t)
            assert rows[-1] == min(max_seqs, t) and list(rows) == sorted(set(rows))
            # a mixed step of T tokens holds at most T sequences (and the engine's max_num_seqs)
            assert all(pick_bucket(n, rows) >= n for n in range(1, min(max_seqs, t) + 1))


def test_default_cpu_mixed_rows():
    b = bucket_table("cpu", max_num_seqs=128, max_num_batched_tokens=512)
    assert [b.mixed_rows(t) for t in b.token_buckets] == [(8, 32), (8, 64), (8, 128), (8, 128), (8, 128)]
