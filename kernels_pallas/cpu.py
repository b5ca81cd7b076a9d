"""Paged attention for XLA:CPU: work proportional to the live tokens (no Pallas backend on CPU).

The dispatcher's second choice on CPU: where the numba kernel of kernels_pallas/ragged_cpu.py supports the case
(float32 pools, numba importable) it runs instead, 2-3x faster than this path at SmolLM2 shapes (decode and mixed
steps alike; benchmarks/README.md). This path runs any dtype (a bfloat16 pool), and without numba.

The reference gathers K/V once per *query token* (O(T * L) copies per layer for a prefill of T tokens over L keys)
and decode reads the whole page-table width (`max_model_len`) of every row. Here the packed query tokens of a
sequence with more than one token are cut into blocks of at most `block_q` tokens, and K/V are gathered once per
*block*: a prefill chunk of T tokens copies its sequence's pages T/block_q times instead of T times. K/V are read in
chunks of `KV_CHUNK_TOKENS` keys with a dynamic trip count, so the work follows the live context, not the table's
width, and no extra shapes are compiled. The blocks run in groups (`RAGGED_GROUP_BLOCKS`), each group's loop only
as far as its own last query token (causal: an early block of a long prefill stops early; dead blocks cost nothing)
and, with a sliding window, from the first chunk its window reaches. Each block attends its sequence's cached
prefix and its own fresh tokens in one masked softmax (causal, sliding window, soft-cap), the chunks merged exactly
by an online softmax (log-sum-exp rescaling).

Sequences with one query token (decodes, in a decode step or a mixed one) take the decode path: K/V gathered as
contiguous [keys, Hkv * D] rows that both dots read in place (a block-diagonal query instead of a transposed copy
of K and V). In a decode step the rows are sorted by length into groups (`DECODE_GROUP_ROWS`), each group walking
its own KV chunks only as far as its longest row.

Same contracts as `kernels_pallas.reference` (table entries past a row's length are ignored, padding tokens and
rows with no keys give zeros).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from kernels_pallas.common import (
    NEG_INF,
    apply_soft_cap,
    cdiv,
    key_mask,
    online_softmax_step,
    safe_normalize,
)

# Query tokens per block: a sequence's last block wastes up to block_q - 1 rows, a prefill chunk copies its pages
# once per block_q tokens. 16 was fastest of 8/16/32 at SmolLM2 shapes (a T=256 mixed step; benchmarks/README); with
# decodes on their own path, 16 still beat 32 on the mixed step, and the two were within noise on a 512-token prefill.
DEFAULT_BLOCK_Q = 16
# Keys per step of the KV loop. The loop runs only as many steps as the longest live sequence needs (a dynamic
# trip count), so however wide the page table (max_model_len), a step reads at most one chunk past the live keys.
KV_CHUNK_TOKENS = 128  # fastest of 64/128/256/512 at SmolLM2 shapes (B=32 decode, T=256 mixed), noisy host
# Blocks per group on the ragged path (each group runs its own KV loop), at most this many groups.
RAGGED_GROUP_BLOCKS = 8
RAGGED_MAX_GROUPS = 8
# Decode: rows per group (each group runs its own KV loop, as far as its longest row), at most this many groups
# (a bigger batch gets bigger groups), and keys per step of a group's loop.
DECODE_GROUP_ROWS = 8
DECODE_MAX_GROUPS = 8
DECODE_KV_CHUNK_TOKENS = 64
# Widest K/V row (Hkv * D elements) the decode path reads with a block-diagonal query (see _decode_group). Measured at
# B=32: block-diagonal faster for 3x64, 2x64, 4x64, 6x64; per-head dots faster for 4x128, 8x64, 8x128.
DECODE_BLOCK_DIAG_MAX_ROW = 384
# Elements of gathered K (or V) per chunk of the KV loop, over all blocks (~64 MiB of f32): a smaller chunk if over.
_GATHER_BUDGET = 1 << 24


def _map_groups(fn, arrays: tuple[jax.Array, ...], size: int, unroll: bool) -> jax.Array:
    """fn over groups of `size` along the leading axis of `arrays` (a multiple of size), results concatenated:
    unrolled (a copy of fn per group in the program), or a loop over groups (one copy: less to compile)."""
    n = arrays[0].shape[0] // size
    if n == 1:
        return fn(*arrays)
    if unroll:
        return jnp.concatenate([fn(*(a[g * size : (g + 1) * size] for a in arrays)) for g in range(n)])

    def body(g, out):
        part = fn(*(lax.dynamic_slice_in_dim(a, g * size, size, axis=0) for a in arrays))
        return lax.dynamic_update_slice_in_dim(out, part, g * size, axis=0)

    shape = jax.eval_shape(fn, *(a[:size] for a in arrays))
    return lax.fori_loop(0, n, body, jnp.zeros((n * size, *shape.shape[1:]), shape.dtype))


def _block_layout(
    query_start_loc: jax.Array,  # i32[S + 1]
    q_len: jax.Array,  # i32[S] tokens of each sequence on the block path (0: none)
    num_tokens: int,
    block_q: int,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Per block: (seq i32[NB], first token i32[NB], its index within the sequence's query i32[NB], live tokens
    i32[NB]); NB = min(T, T // block_q + S) bounds sum over sequences of ceil(q_len / block_q)."""
    max_seqs = query_start_loc.shape[0] - 1
    nblocks = cdiv(q_len, block_q)
    ends = jnp.cumsum(nblocks)  # blocks of sequences [0, s]
    num_blocks = min(num_tokens, num_tokens // block_q + max_seqs)  # and every block holds a token
    b = jnp.arange(num_blocks, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(ends, b, side="right").astype(jnp.int32), max_seqs - 1)
    j = b - (ends[seq] - nblocks[seq])  # block index inside its sequence
    first = query_start_loc[seq] + j * block_q
    n_live = jnp.where(b < ends[-1], jnp.clip(q_len[seq] - j * block_q, 0, block_q), 0)
    return seq, first, j, n_live


def _block_group(
    qb: jax.Array,  # f[NB, Hkv, R, D] R = block_q * G query rows per (block, KV head)
    q_pos_rows: jax.Array,  # i32[NB, R] absolute position of each row's token, -1 for padding rows
    kv_len: jax.Array,  # i32[NB] keys of the block's sequence (0: dead block)
    page_ids: jax.Array,  # i32[NB, W'] W' a multiple of chunk_pages, entries past kv_len point at page 0
    k_pages: jax.Array,  # f[num_pages, page_size, Hkv, D]
    v_pages: jax.Array,  # f[num_pages, page_size, Hkv, D]
    *,
    scale: float,
    sliding_window: int,
    soft_cap: float | None,
    chunk_pages: int,
) -> jax.Array:  # f32[NB, Hkv, R, D]
    """Attention of a group of blocks, KV chunks only as far as its last query token (causal: a block never reads
    keys past its own tokens) and, with a sliding window, from the first chunk its earliest window reaches."""
    num_blocks, num_kv_heads, rows, head_dim = qb.shape
    page_size = k_pages.shape[1]
    chunk = chunk_pages * page_size

    def body(c, carry):
        acc, m, denom = carry  # f32[NB, Hkv, R, D], f32[NB, Hkv, R], f32[NB, Hkv, R]
        ids = lax.dynamic_slice_in_dim(page_ids, c * chunk_pages, chunk_pages, axis=1)
        # [NB, Hkv, C, D]: heads ahead of keys, so the dots take K and V as they are. Left to the einsum, K would be
        # transposed to [NB, Hkv, D, C] instead, a 4-byte strided copy (slower: a 512-token prefill ~10%).
        k = jnp.take(k_pages, ids, axis=0, mode="clip").reshape(num_blocks, chunk, num_kv_heads, head_dim)
        v = jnp.take(v_pages, ids, axis=0, mode="clip").reshape(num_blocks, chunk, num_kv_heads, head_dim)
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
        k_pos = c * chunk + jnp.arange(chunk, dtype=jnp.int32)[None, :]  # [1, C]
        # Slots past the end may hold NaN/Inf garbage; p == 0 there, but 0 * NaN = NaN, so zero V itself.
        v = jnp.where((k_pos < kv_len[:, None])[:, None, :, None], v, jnp.zeros((), v.dtype))
        s = jnp.einsum("bhrd,bhcd->bhrc", qb, k, preferred_element_type=jnp.float32)
        s = apply_soft_cap(s * scale, soft_cap)
        mask = key_mask(q_pos_rows[:, :, None], k_pos[:, None, :], kv_len[:, None, None], sliding_window)
        s = jnp.where(mask[:, None], s, NEG_INF)  # [NB, Hkv, R, C]
        p, corr, m, denom = online_softmax_step(s, m, denom)
        pv = jnp.einsum("bhrc,bhcd->bhrd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return acc * corr[..., None] + pv, m, denom

    init = (
        jnp.zeros((num_blocks, num_kv_heads, rows, head_dim), jnp.float32),
        jnp.full((num_blocks, num_kv_heads, rows), NEG_INF, jnp.float32),
        jnp.zeros((num_blocks, num_kv_heads, rows), jnp.float32),
    )
    stop = cdiv(jnp.max(q_pos_rows, initial=-1) + 1, chunk)  # padding rows are -1
    start = 0
    if sliding_window > 0:
        live = q_pos_rows >= 0
        first = jnp.where(live, jnp.maximum(q_pos_rows - sliding_window + 1, 0), page_ids.shape[1] * page_size)
        start = jnp.minimum(jnp.min(first) // chunk, stop)
    acc, _, denom = lax.fori_loop(start, stop, body, init)
    return safe_normalize(acc, denom)


def ragged_paged_attention(
    q: jax.Array,  # f[T, Hq, D] query tokens of all sequences, packed
    k_pages: jax.Array,  # f[num_pages, page_size, Hkv, D] (new tokens' K/V already written)
    v_pages: jax.Array,  # f[num_pages, page_size, Hkv, D]
    page_table: jax.Array,  # i32[max_seqs, W] W pages (at least each live row's)
    context_lens: jax.Array,  # i32[max_seqs] KV length incl. the new query tokens
    query_start_loc: jax.Array,  # i32[max_seqs + 1]
    num_seqs: jax.Array,  # i32[] (or i32[1])
    *,
    scale: float,
    sliding_window: int = 0,
    soft_cap: float | None = None,
    block_q: int = DEFAULT_BLOCK_Q,
) -> jax.Array:  # f[T, Hq, D], zeros for padding tokens
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_pages.shape
    group = num_q_heads // num_kv_heads
    width = page_table.shape[1]
    max_seqs = query_start_loc.shape[0] - 1
    block_q = max(1, min(block_q, num_tokens))
    num_seqs = jnp.asarray(num_seqs, jnp.int32).reshape(())
    context_lens = context_lens.astype(jnp.int32)
    query_start_loc = query_start_loc.astype(jnp.int32)
    page_table = page_table.astype(jnp.int32)
    opts = dict(scale=scale, sliding_window=sliding_window, soft_cap=soft_cap)

    live = jnp.arange(max_seqs, dtype=jnp.int32) < num_seqs
    seq_q_len = jnp.clip(jnp.where(live, query_start_loc[1:] - query_start_loc[:-1], 0), 0, num_tokens)
    # Sequences with one query token (decodes) take the decode path: a block of one token would waste the rest of
    # its block_q rows. The others are cut into blocks.
    one = seq_q_len == 1
    one_tok = jnp.clip(query_start_loc[:-1], 0, num_tokens - 1)
    # One group (no sort): in this program, groups of decode rows cost more compile time (~1.4 s more for 30
    # layers) than they save at run time (a few %: a mixed step's decodes are the smaller part of it).
    one_lens = jnp.where(one, jnp.maximum(context_lens, 0), 0)
    chunk_pages = max(1, min(width, DECODE_KV_CHUNK_TOKENS // page_size))
    one_out = _decode_group(q[one_tok], k_pages, v_pages, page_table, one_lens, **opts, chunk_pages=chunk_pages)

    seq, first, j, n_live = _block_layout(query_start_loc, jnp.where(one, 0, seq_q_len), num_tokens, block_q)
    num_blocks = seq.shape[0]
    q_len = seq_q_len[seq]
    kv_len = jnp.where(n_live > 0, context_lens[seq], 0)  # [NB]
    i = jnp.arange(block_q, dtype=jnp.int32)[None, :]
    row_live = i < n_live[:, None]  # [NB, Bq]
    tok = jnp.where(row_live, first[:, None] + i, num_tokens)  # padding rows scatter past the end (dropped)
    q_pos = jnp.where(row_live, kv_len[:, None] - q_len[:, None] + j[:, None] * block_q + i, -1)  # [NB, Bq]

    # [NB, Hkv, Bq * G, D]: one matmul per (block, KV head) covers the block's tokens and the head's query group.
    qb = jnp.take(q, jnp.minimum(tok, num_tokens - 1), axis=0)  # [NB, Bq, Hq, D]
    qb = qb.reshape(num_blocks, block_q, num_kv_heads, group, head_dim).transpose(0, 2, 1, 3, 4)
    qb = qb.reshape(num_blocks, num_kv_heads, block_q * group, head_dim)
    q_pos_rows = jnp.repeat(q_pos, group, axis=1)  # [NB, Bq * G], row r is token r // G

    # Blocks in groups, each with its own KV loop: dead blocks (past the live ones) cost nothing, and an early block
    # of a long prefill stops at its own last token. A loop over the groups: unrolled they compiled ~2x slower.
    gb = max(RAGGED_GROUP_BLOCKS, cdiv(num_blocks, RAGGED_MAX_GROUPS))
    pad = cdiv(num_blocks, gb) * gb - num_blocks
    # Pages past a row's length point at page 0 (always in range); the key mask hides what it holds.
    used = jnp.arange(width, dtype=jnp.int32)[None, :] < cdiv(kv_len, page_size)[:, None]
    page_ids = jnp.where(used, page_table[seq], 0)  # [NB, W]
    by_budget = _GATHER_BUDGET // max(1, min(gb, num_blocks) * page_size * num_kv_heads * head_dim)
    chunk_pages = max(1, min(width, KV_CHUNK_TOKENS // page_size, by_budget))
    page_ids = jnp.pad(page_ids, ((0, pad), (0, cdiv(width, chunk_pages) * chunk_pages - width)))
    qb = jnp.pad(qb, ((0, pad), (0, 0), (0, 0), (0, 0)))
    q_pos_rows = jnp.pad(q_pos_rows, ((0, pad), (0, 0)), constant_values=-1)
    kv_len = jnp.pad(kv_len, (0, pad))
    group_fn = lambda *a: _block_group(*a, k_pages, v_pages, chunk_pages=chunk_pages, **opts)
    out = _map_groups(group_fn, (qb, q_pos_rows, kv_len, page_ids), gb, unroll=False)[:num_blocks]
    out = out.reshape(num_blocks, num_kv_heads, block_q, group, head_dim).transpose(0, 2, 1, 3, 4)
    out = out.reshape(num_blocks * block_q, num_q_heads, head_dim).astype(q.dtype)
    result = jnp.zeros((num_tokens, num_q_heads, head_dim), q.dtype)
    result = result.at[tok.reshape(-1)].set(out, mode="drop", unique_indices=True)
    return result.at[jnp.where(one, one_tok, num_tokens)].set(one_out.astype(q.dtype), mode="drop")


def _decode_group(
    q: jax.Array,  # f[R, Hq, D] one query token per row
    k_pages: jax.Array,  # f[num_pages, page_size, Hkv, D]
    v_pages: jax.Array,  # f[num_pages, page_size, Hkv, D]
    page_table: jax.Array,  # i32[R, W]
    lengths: jax.Array,  # i32[R] >= 0
    *,
    scale: float,
    sliding_window: int,
    soft_cap: float | None,
    chunk_pages: int,
) -> jax.Array:  # f32[R, Hq, D]
    """Decode attention of a group of rows, KV chunks only as far as the group's longest row (and, with a sliding
    window, from the earliest chunk any row's window reaches)."""
    rows, num_q_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, _ = k_pages.shape
    group = num_q_heads // num_kv_heads
    width = page_table.shape[1]
    row_dim = num_kv_heads * head_dim
    chunk = chunk_pages * page_size
    q_pos = lengths - 1
    kv_len = jnp.minimum(lengths, width * page_size)  # keys past the table do not exist
    qs = q.astype(jnp.float32) * scale
    # A gathered key is one row of all its KV heads, [C, Hkv * D]. Narrow rows (SmolLM2: 3 x 64): both dots take it
    # as it is, and query head h gets a block-diagonal [Hq, Hkv * D] operand, zero outside KV head h // G; the dots
    # do Hkv times the useful flops, which costs less than transposing K and V. Wide rows: K and V transposed to
    # [R, Hkv, C, D] and one small dot per (row, KV head), as the flops would cost more (8 x 128: ~2x slower).
    block_diag = num_kv_heads == 1 or row_dim <= DECODE_BLOCK_DIAG_MAX_ROW
    if block_diag:
        own_head = jnp.arange(num_q_heads)[:, None] // group == jnp.arange(num_kv_heads)[None, :]  # [Hq, Hkv]
        q_op = jnp.where(own_head[None, :, :, None], qs[:, :, None, :], 0.0).reshape(rows, num_q_heads, row_dim)
        acc_shape = (rows, num_q_heads, row_dim)
    else:
        q_op = qs.reshape(rows, num_kv_heads, group, head_dim)
        acc_shape = (rows, num_kv_heads, group, head_dim)
    used = jnp.arange(width, dtype=jnp.int32)[None, :] < cdiv(kv_len, page_size)[:, None]
    page_ids = jnp.where(used, page_table, 0)  # entries past a row's pages may be garbage: page 0, masked
    page_ids = jnp.pad(page_ids, ((0, 0), (0, cdiv(width, chunk_pages) * chunk_pages - width)))
    k_rows = k_pages.reshape(num_pages, page_size, row_dim)
    v_rows = v_pages.reshape(num_pages, page_size, row_dim)

    def body(c, carry):
        acc, m, denom = carry  # f32[acc_shape], f32[R, Hq], f32[R, Hq]
        ids = lax.dynamic_slice_in_dim(page_ids, c * chunk_pages, chunk_pages, axis=1)
        k = jnp.take(k_rows, ids, axis=0, mode="clip").reshape(rows, chunk, row_dim).astype(jnp.float32)
        v = jnp.take(v_rows, ids, axis=0, mode="clip").reshape(rows, chunk, row_dim).astype(jnp.float32)
        k_pos = c * chunk + jnp.arange(chunk, dtype=jnp.int32)[None, :]  # [1, C]
        # Slots past the end may hold NaN/Inf garbage; p == 0 there, but 0 * NaN = NaN, so zero V itself.
        v = jnp.where((k_pos < kv_len[:, None])[:, :, None], v, 0.0)
        if block_diag:
            s = jnp.einsum("rnk,rck->rnc", q_op, k, preferred_element_type=jnp.float32)
        else:
            k = k.reshape(rows, chunk, num_kv_heads, head_dim).transpose(0, 2, 1, 3)
            v = v.reshape(rows, chunk, num_kv_heads, head_dim).transpose(0, 2, 1, 3)
            s = jnp.einsum("rhgd,rhcd->rhgc", q_op, k, preferred_element_type=jnp.float32)
            s = s.reshape(rows, num_q_heads, chunk)
        s = apply_soft_cap(s, soft_cap)
        mask = key_mask(q_pos[:, None], k_pos, kv_len[:, None], sliding_window)  # [R, C]
        s = jnp.where(mask[:, None, :], s, NEG_INF)  # [R, Hq, C]
        p, corr, m, denom = online_softmax_step(s, m, denom)
        if block_diag:
            pv = jnp.einsum("rnc,rck->rnk", p, v, preferred_element_type=jnp.float32)
        else:
            pv = jnp.einsum("rhgc,rhcd->rhgd", p.reshape(rows, num_kv_heads, group, chunk), v)
        corr_acc = corr.reshape(acc_shape[:-1])[..., None]
        return acc * corr_acc + pv, m, denom

    init = (
        jnp.zeros(acc_shape, jnp.float32),
        jnp.full((rows, num_q_heads), NEG_INF, jnp.float32),
        jnp.zeros((rows, num_q_heads), jnp.float32),
    )
    stop = cdiv(jnp.max(kv_len, initial=0), chunk)
    start = 0
    if sliding_window > 0:  # chunks wholly before every row's window hold no key of this group
        first = jnp.where(kv_len > 0, jnp.maximum(q_pos - sliding_window + 1, 0), width * page_size)
        start = jnp.minimum(jnp.min(first) // chunk, stop)
    acc, _, denom = lax.fori_loop(start, stop, body, init)
    if block_diag:  # query head h keeps the block of its own KV head h // G
        acc = acc.reshape(rows, num_kv_heads, group, num_kv_heads, head_dim)
        acc = jnp.moveaxis(jnp.diagonal(acc, axis1=1, axis2=3), -1, 1)
    return safe_normalize(acc.reshape(rows, num_q_heads, head_dim), denom)


def _decode_rows(
    q: jax.Array,  # f[B, Hq, D] one query token per row
    k_pages: jax.Array,  # f[num_pages, page_size, Hkv, D]
    v_pages: jax.Array,  # f[num_pages, page_size, Hkv, D]
    page_table: jax.Array,  # i32[B, W]
    lengths: jax.Array,  # i32[B] valid KV tokens incl. the current one (0: no keys, zeros out)
    *,
    scale: float,
    sliding_window: int,
    soft_cap: float | None,
) -> jax.Array:  # f32[B, Hq, D]
    """Rows sorted by length and cut into groups of `DECODE_GROUP_ROWS`, each group with its own KV loop: a short
    row does not walk the longest row's chunks, and a group's gathered K/V stay small enough to be read back from
    cache by the dots."""
    batch = q.shape[0]
    page_size, width = k_pages.shape[1], page_table.shape[1]
    lengths = jnp.maximum(lengths.astype(jnp.int32), 0)
    page_table = page_table.astype(jnp.int32)
    opts = dict(scale=scale, sliding_window=sliding_window, soft_cap=soft_cap)
    opts["chunk_pages"] = max(1, min(width, DECODE_KV_CHUNK_TOKENS // page_size))
    rows = max(DECODE_GROUP_ROWS, cdiv(batch, DECODE_MAX_GROUPS))
    if batch <= rows:
        return _decode_group(q, k_pages, v_pages, page_table, lengths, **opts)
    order = jnp.argsort(-lengths, stable=True)  # longest first: rows of similar length share a group
    pad = cdiv(batch, rows) * rows - batch
    qs = jnp.pad(q[order], ((0, pad), (0, 0), (0, 0)))
    tables = jnp.pad(page_table[order], ((0, pad), (0, 0)))
    lens = jnp.pad(lengths[order], (0, pad))  # padding rows: length 0, no keys
    # Groups unrolled: 15-20% faster at B=32 than a loop over them, for ~2 s more compile time over 30 layers.
    group_fn = lambda *a: _decode_group(a[0], k_pages, v_pages, *a[1:], **opts)
    out = _map_groups(group_fn, (qs, tables, lens), rows, unroll=True)
    return jnp.zeros(out[:batch].shape, out.dtype).at[order].set(out[:batch], unique_indices=True)


def paged_decode_attention(
    q: jax.Array,  # f[B, Hq, D] one query token per sequence
    k_pages: jax.Array,  # f[num_pages, page_size, Hkv, D]
    v_pages: jax.Array,  # f[num_pages, page_size, Hkv, D]
    page_table: jax.Array,  # i32[B, W]
    lengths: jax.Array,  # i32[B] valid KV tokens incl. the current one
    *,
    scale: float,
    sliding_window: int = 0,
    soft_cap: float | None = None,
) -> jax.Array:  # f[B, Hq, D], zeros for rows with length 0
    """One query token per row: rows grouped by length, K/V read in place (see the module docstring)."""
    out = _decode_rows(q, k_pages, v_pages, page_table, lengths, scale=scale, sliding_window=sliding_window,
                       soft_cap=soft_cap)  # fmt: skip
    return out.astype(q.dtype)
