"""The engine's StepPacker (buffers and page tables kept across steps) packs exactly what a one-off pack does."""

from __future__ import annotations

import random

import numpy as np
import pytest

from jaxinfer.step import PageTables, SeqChunk, StepPacker, pack


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_packer_equals_one_off_pack_over_many_steps(seed):
    rng = random.Random(seed)
    page_size, pages_per_seq, max_seqs = 4, 6, 5
    packer = StepPacker(pages_per_seq, page_size, max_seqs)
    live: list[dict] = []
    next_page = 0
    for _ in range(300):
        # Sequences come and go; pages grow in place; a preempted sequence gets a new page list.
        if len(live) < 8 and rng.random() < 0.4:
            live.append({"pages": [], "len": 0})
        if live and rng.random() < 0.15:
            live.pop(rng.randrange(len(live)))
        if live and rng.random() < 0.1:
            victim = rng.choice(live)
            victim["pages"], victim["len"] = [], 0  # released: a fresh list
        batch = rng.sample(live, min(len(live), rng.randint(0, max_seqs)))
        chunks = []
        for seq in batch:
            n = rng.randint(1, 3)
            if seq["len"] + n > pages_per_seq * page_size:
                continue
            while len(seq["pages"]) * page_size < seq["len"] + n:
                seq["pages"] += [next_page % 97]
                next_page += 1
            chunks.append(SeqChunk([rng.randrange(50) for _ in range(n)], seq["len"], seq["pages"]))
            seq["len"] += n
        t = max(8, sum(len(c.token_ids) for c in chunks))
        got, want = packer.pack(chunks, t, max_seqs), pack(chunks, t, max_seqs, pages_per_seq, page_size)
        for name, a in want.shapes().items():
            np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
            assert a == getattr(got, name).shape


def test_page_tables_write_only_new_pages_and_recycle_rows():
    tables = PageTables(num_rows=4, pages_per_seq=3)
    a, b = [7], [8, 9]
    ra, rb = tables.rows([a, b])
    a.append(5)
    assert tables.rows([a])[0] == ra and tables.table[ra, :2].tolist() == [7, 5]
    # More lists than rows: the rows of lists not used lately are recycled, never one of the current step.
    lists = [[i] for i in range(10)]
    for lst in lists:
        (row,) = tables.rows([lst])
        assert tables.table[row, 0] == lst[0]
    step = lists[-4:]
    rows = tables.rows(step)
    assert len(set(rows.tolist())) == 4 and [tables.table[r, 0] for r in rows] == [x[0] for x in step]
    (rb2,) = tables.rows([b])  # b was recycled: it gets a row again, written from its first page
    assert tables.table[rb2, :2].tolist() == [8, 9]
