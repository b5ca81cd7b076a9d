"""The numba side of kernels_pallas/decode_cpu.py: the decode attention kernel and its XLA FFI handler.

Imported on first use only (importing numba and loading the cached machine code takes about a second): compiled
once per machine into numba's cache (`__pycache__` beside this file, or NUMBA_CACHE_DIR), about 10 s.
"""

from __future__ import annotations

import numpy as np
from numba import carray, cfunc, njit, prange, types

from kernels_pallas.numba_ffi import jit_helpers, start_threads

start_threads()  # before the cached parallel code below loads
_h = jit_helpers()
answer_non_execute, buffer, data, dim, null = _h.answer_non_execute, _h.buffer, _h.data, _h.dim, _h.null


# Query heads per pass over a row's keys: each key (and value) loaded once feeds this many dot products (and
# accumulators). A group that is not a multiple repeats its last head in the spare lanes (computed, not stored).
# Four independent accumulators in the inner loops ran 1.3-1.8x faster than a loop over a [G, D] accumulator.
_HEADS_PER_PASS = 4


@njit(fastmath=True, nogil=True, cache=True)
def _attend_head(q, k, v, table, length, head, out, scale, window, cap, scores):
    """One row's query heads of KV head `head`: q f32[G, D] -> out f32[G, D]; scores f32[G, >= keys] scratch."""
    group, head_dim = q.shape
    num_pages, page_size = k.shape[0], k.shape[1]
    length = min(max(length, 0), table.shape[0] * page_size)  # keys past the table do not exist
    first = max(length - window, 0) if window > 0 else 0
    if length == 0:
        out[:, :] = 0.0
        return
    first_page, end_page = first // page_size, (length + page_size - 1) // page_size
    qs = q * scale
    acc = np.empty((_HEADS_PER_PASS, head_dim), np.float32)
    for g0 in range(0, group, _HEADS_PER_PASS):
        n1, n2, n3 = min(g0 + 1, group - 1), min(g0 + 2, group - 1), min(g0 + 3, group - 1)
        q0, q1, q2, q3 = qs[g0], qs[n1], qs[n2], qs[n3]
        for pi in range(first_page, end_page):
            page = min(max(table[pi], 0), num_pages - 1)  # a bad table entry must not read outside the pool
            for j in range(max(first - pi * page_size, 0), min(page_size, length - pi * page_size)):
                key = k[page, j, head]
                a0 = a1 = a2 = a3 = np.float32(0.0)
                for d in range(head_dim):
                    kd = key[d]
                    a0 += q0[d] * kd
                    a1 += q1[d] * kd
                    a2 += q2[d] * kd
                    a3 += q3[d] * kd
                t = pi * page_size + j
                scores[g0, t], scores[n1, t], scores[n2, t], scores[n3, t] = a0, a1, a2, a3
    for g in range(group):
        row = scores[g]
        if cap > 0:
            for t in range(first, length):
                row[t] = cap * np.tanh(row[t] / cap)
        m = row[first]
        for t in range(first + 1, length):
            m = max(m, row[t])
        total = np.float32(0.0)
        for t in range(first, length):
            e = np.exp(row[t] - m)
            row[t] = e
            total += e
        inv = np.float32(1.0) / total
        for t in range(first, length):
            row[t] *= inv
    for g0 in range(0, group, _HEADS_PER_PASS):
        n1, n2, n3 = min(g0 + 1, group - 1), min(g0 + 2, group - 1), min(g0 + 3, group - 1)
        acc[:, :] = 0.0
        a0, a1, a2, a3 = acc[0], acc[1], acc[2], acc[3]
        for pi in range(first_page, end_page):
            page = min(max(table[pi], 0), num_pages - 1)
            for j in range(max(first - pi * page_size, 0), min(page_size, length - pi * page_size)):
                val = v[page, j, head]
                t = pi * page_size + j
                w0, w1, w2, w3 = scores[g0, t], scores[n1, t], scores[n2, t], scores[n3, t]
                for d in range(head_dim):
                    vd = val[d]
                    a0[d] += w0 * vd
                    a1[d] += w1 * vd
                    a2[d] += w2 * vd
                    a3[d] += w3 * vd
        for g in range(g0, min(g0 + _HEADS_PER_PASS, group)):
            out[g] = acc[g - g0]


@njit(fastmath=True, nogil=True, cache=True, parallel=True)
def _attend_rows(q, k, v, table, lengths, out, scale, window, cap, threads):
    rows, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    group = num_q_heads // num_kv_heads
    keys = table.shape[1] * k.shape[1]
    # One work item per (row, KV head), dealt round-robin to the threads (prange alone hands each thread one
    # contiguous range): rows of different lengths balance, and a batch of one still has a head per thread.
    items = rows * num_kv_heads
    workers = max(1, min(threads, items))
    for w in prange(workers):
        scores = np.empty((group, keys), np.float32)
        for item in range(w, items, workers):
            r, h = item // num_kv_heads, item % num_kv_heads
            heads = slice(h * group, (h + 1) * group)
            _attend_head(q[r, heads], k, v, table[r], lengths[r], h, out[r, heads], scale, window, cap, scores)


@cfunc(types.voidptr(types.voidptr), cache=True)
def handler(frame_ptr):
    frame = carray(frame_ptr, (15,), dtype=np.int64)
    if answer_non_execute(frame):
        return null()
    bq, bk, bv = buffer(frame, 0, False), buffer(frame, 1, False), buffer(frame, 2, False)
    bt, bl, bs = buffer(frame, 3, False), buffer(frame, 4, False), buffer(frame, 5, False)
    rows, num_q_heads, head_dim = dim(bq, 0), dim(bq, 1), dim(bq, 2)
    num_pages, page_size, num_kv_heads = dim(bk, 0), dim(bk, 1), dim(bk, 2)
    width = dim(bt, 1)
    pool = (num_pages, page_size, num_kv_heads, head_dim)
    q = carray(data(bq), (rows, num_q_heads, head_dim), dtype=np.float32)
    k = carray(data(bk), pool, dtype=np.float32)
    v = carray(data(bv), pool, dtype=np.float32)
    table = carray(data(bt), (rows, width), dtype=np.int32)
    lengths = carray(data(bl), (rows,), dtype=np.int32)
    settings = carray(data(bs), (4,), dtype=np.float32)
    out = carray(data(buffer(frame, 0, True)), (rows, num_q_heads, head_dim), dtype=np.float32)
    _attend_rows(q, k, v, table, lengths, out, settings[0], np.int64(settings[1]), settings[2], np.int64(settings[3]))
    return null()
