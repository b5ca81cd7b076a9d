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
