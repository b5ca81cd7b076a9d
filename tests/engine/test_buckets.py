"""The per-backend bucket table and the runner's page-table narrowing (jaxinfer.step.bucket_table)."""

from __future__ import annotations

import numpy as np
import pytest

from jaxinfer.step import SeqChunk, StepPacker, bucket_table, narrow, pick_bucket


def test_cpu_buckets_decode_at_batch_one_and_narrow_pages():
    b = bucket_table("cpu", max_num_seqs=32, max_num_batched_tokens=256, pages_per_seq=256)
    assert b.seq_buckets == (1, 8, 16, 32)
    assert b.token_buckets == (32, 64, 128, 256)
    assert b.page_buckets == (16, 32, 64, 128, 256)


@pytest.mark.parametrize("backend", ["gpu", "tpu", "rocm"])
def test_accelerators_keep_the_full_table(backend):
    b = bucket_table(backend, max_num_seqs=32, max_num_batched_tokens=256, pages_per_seq=100)
    assert b.seq_buckets == (8, 16, 32) and b.page_buckets == (100,)


def test_multi_process_keeps_the_full_table():
    assert bucket_table("cpu", 4, 32, 100, narrow_pages=False).page_buckets == (100,)


@pytest.mark.parametrize("max_seqs, pages", [(1, 3), (4, 12), (3, 40)])
def test_small_limits_are_their_own_buckets(max_seqs, pages):
    b = bucket_table("cpu", max_seqs, 32, pages)
    assert b.seq_buckets[-1] == max_seqs and b.page_buckets[-1] == pages
    assert all(pick_bucket(n, b.seq_buckets) >= n for n in range(1, max_seqs + 1))


def test_narrowed_table_keeps_every_live_page():
    packer = StepPacker(pages_per_seq=64, page_size=4, max_seqs=4)
    chunks = [SeqChunk([1] * 5, 0, [7, 9]), SeqChunk([2], 70, list(range(10, 28)))]  # 18 live pages: bucket 32
    inp = packer.pack(chunks, 8, 4)
    narrowed = narrow(inp, chunks, 4, bucket_table("cpu", 4, 32, 64).page_buckets).page_table
    assert narrowed.shape == (4, 32) and inp.page_table.shape == (4, 64)
    assert narrow(inp, chunks, 4, (64,)) is inp
    for row, c in enumerate(chunks):
        np.testing.assert_array_equal(narrowed[row, : len(c.pages)], c.pages)
