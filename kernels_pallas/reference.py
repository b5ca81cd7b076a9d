"""Pure-jnp paged attention: the oracle for the kernel tests and the dispatcher's last fallback.

Layouts (one layer's KV pool):
  k_pages, v_pages: [num_pages, page_size, num_kv_heads, head_dim]
  page_table:       i32[num_rows, pages_per_seq]; entries past a row's last used page are ignored (may be
                    garbage), so a freed/recycled page id there is harmless.
GQA: num_q_heads = G * num_kv_heads and q head h reads kv head h // G.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from kernels_pallas.common import NEG_INF, apply_soft_cap, cdiv, key_mask, online_softmax_step

# Elements of gathered K (or V) materialised per step by the ragged reference. Each query token gathers
# its own sequence's pages, so memory is O(tokens * chunk); this caps it (~128 MiB of bf16).
_RAGGED_GATHER_BUDGET = 1 << 26


def _masked_page_ids(
    page_table: jax.Array,  # i32[R, P]
    kv_lens: jax.Array,  # i32[R]
    page_size: int,
) -> jax.Array:  # i32[R, P]
    # Page-table entries past the last used page may be stale or garbage: point them at page 0 (always a
    # valid index) so the gather never goes out of range; the key mask hides whatever page 0 holds.
    used = jnp.arange(page_table.shape[1], dtype=jnp.int32)[None, :] < cdiv(kv_lens, page_size)[:, None]
    return jnp.where(used, page_table, 0)


def paged_decode_attention(
    q: jax.Array,  # f[B, Hq, D] one query token per sequence
    k_pages: jax.Array,  # f[num_pages, page_size, Hkv, D]
    v_pages: jax.Array,  # f[num_pages, page_size, Hkv, D]
    page_table: jax.Array,  # i32[B, pages_per_seq]
    lengths: jax.Array,  # i32[B] valid KV tokens incl. the current one; query sits at lengths - 1
    *,
    scale: float,
    sliding_window: int = 0,
    soft_cap: float | None = None,
) -> jax.Array:  # f[B, Hq, D], zeros for rows with length 0
    batch, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_pages.shape
    group = num_q_heads // num_kv_heads
    seq_cap = page_table.shape[1] * page_size
    lengths = lengths.astype(jnp.int32)

    # One gather of each row's pages into a contiguous [B, S, Hkv, D] copy: simple, and for a single query
    # token per row this is exactly the KV that has to be read anyway.
    page_ids = _masked_page_ids(page_table.astype(jnp.int32), lengths, page_size)
    k = jnp.take(k_pages, page_ids, axis=0, mode="clip").reshape(batch, seq_cap, num_kv_heads, head_dim)
    v = jnp.take(v_pages, page_ids, axis=0, mode="clip").reshape(batch, seq_cap, num_kv_heads, head_dim)

    k_pos = jnp.arange(seq_cap, dtype=jnp.int32)[None, :]  # [1, S]
    mask = key_mask((lengths - 1)[:, None], k_pos, lengths[:, None], sliding_window)  # [B, S]
    # Slots past the end may hold NaN/Inf garbage; p == 0 there, but 0 * NaN = NaN, so zero V itself.
    v = jnp.where((k_pos < lengths[:, None])[:, :, None, None], v, jnp.zeros((), v.dtype))

    qg = q.reshape(batch, num_kv_heads, group, head_dim)
    logits = jnp.einsum("bhgd,bshd->bhgs", qg, k, preferred_element_type=jnp.float32, precision=lax.Precision.HIGHEST)
    logits = apply_soft_cap(logits * scale, soft_cap)
    logits = jnp.where(mask[:, None, None, :], logits, NEG_INF)

    m = jnp.max(logits, axis=-1, keepdims=True)
    p = jnp.exp(logits - jnp.where(m == NEG_INF, 0.0, m))  # length-0 rows: all p == 0
    denom = jnp.sum(p, axis=-1, keepdims=True)
    out = jnp.einsum(
        "bhgs,bshd->bhgd",
        p,
        v.astype(jnp.float32),
        preferred_element_type=jnp.float32,
        precision=lax.Precision.HIGHEST,
    )
    out = out / jnp.where(denom == 0.0, 1.0, denom)
    return out.reshape(batch, num_q_heads, head_dim).astype(q.dtype)


def token_layout(
    query_start_loc: jax.Array,  # i32[max_seqs + 1] cumulative query lengths
    context_lens: jax.Array,  # i32[max_seqs] KV length incl. the new tokens
    num_seqs: jax.Array,  # i32[] rows >= num_seqs are padding
    num_tokens: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per packed token: (seq i32[T], absolute position i32[T] or -1 for padding, valid bool[T])."""
    max_seqs = context_lens.shape[0]
    tok = jnp.arange(num_tokens, dtype=jnp.int32)
    row_live = jnp.arange(max_seqs, dtype=jnp.int32) < num_seqs
    # Entries of padding rows may be garbage: replace them by INT_MAX so the array stays sorted.
    ends = jnp.where(row_live, query_start_loc[1:], jnp.iinfo(jnp.int32).max)
    seq = jnp.minimum(jnp.searchsorted(ends, tok, side="right").astype(jnp.int32), max_seqs - 1)
    valid = tok < query_start_loc[jnp.clip(num_seqs, 0, max_seqs)]
    q_len = query_start_loc[seq + 1] - query_start_loc[seq]
    pos = context_lens[seq] - q_len + (tok - query_start_loc[seq])
    return seq, jnp.where(valid, pos, -1), valid


def ragged_paged_attention(
    q: jax.Array,  # f[T, Hq, D] query tokens of all sequences, packed
    k_pages: jax.Array,  # f[num_pages, page_size, Hkv, D] (new tokens' K/V already written)
    v_pages: jax.Array,  # f[num_pages, page_size, Hkv, D]
    page_table: jax.Array,  # i32[max_seqs, pages_per_seq]
    context_lens: jax.Array,  # i32[max_seqs] total KV length incl. the new query tokens
    query_start_loc: jax.Array,  # i32[max_seqs + 1] cumulative query lengths
    num_seqs: jax.Array,  # i32[] (or i32[1]) live rows
    *,
    scale: float,
    sliding_window: int = 0,
    soft_cap: float | None = None,
    kv_chunk_pages: int | None = None,
) -> jax.Array:  # f[T, Hq, D], zeros for padding tokens
    """Causal attention of each packed query token over its own sequence's pages.

    Streams the page table in chunks of ``kv_chunk_pages`` pages with an online softmax, so the per-token
    gather never materialises more than a bounded chunk of K/V.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_pages.shape
    group = num_q_heads // num_kv_heads
    pages_per_seq = page_table.shape[1]
    num_seqs = jnp.asarray(num_seqs, jnp.int32).reshape(())
    context_lens = context_lens.astype(jnp.int32)
    query_start_loc = query_start_loc.astype(jnp.int32)

    seq, q_pos, valid = token_layout(query_start_loc, context_lens, num_seqs, num_tokens)
    kv_len = jnp.where(valid, context_lens[seq], 0)  # [T]

    if kv_chunk_pages is None:
        per_page = max(1, num_tokens * page_size * num_kv_heads * head_dim)
        kv_chunk_pages = max(1, min(pages_per_seq, _RAGGED_GATHER_BUDGET // per_page))
    chunk_tokens = kv_chunk_pages * page_size
    padded_pages = cdiv(pages_per_seq, kv_chunk_pages) * kv_chunk_pages
    page_ids = _masked_page_ids(page_table.astype(jnp.int32), context_lens, page_size)
    page_ids = jnp.pad(page_ids, ((0, 0), (0, padded_pages - pages_per_seq)))[seq]  # [T, P_pad]

    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)

    def body(j, carry):
        acc, m, denom = carry  # f32[T, Hkv, G, D], f32[T, Hkv, G], f32[T, Hkv, G]
        ids = lax.dynamic_slice_in_dim(page_ids, j * kv_chunk_pages, kv_chunk_pages, axis=1)
        k = jnp.take(k_pages, ids, axis=0, mode="clip").reshape(num_tokens, chunk_tokens, num_kv_heads, -1)
        v = jnp.take(v_pages, ids, axis=0, mode="clip").reshape(num_tokens, chunk_tokens, num_kv_heads, -1)
        k_pos = j * chunk_tokens + jnp.arange(chunk_tokens, dtype=jnp.int32)[None, :]  # [1, C]
        mask = key_mask(q_pos[:, None], k_pos, kv_len[:, None], sliding_window)  # [T, C]
        v = jnp.where((k_pos < kv_len[:, None])[:, :, None, None], v, jnp.zeros((), v.dtype))
        logits = jnp.einsum(
            "thgd,tshd->thgs", qg, k, preferred_element_type=jnp.float32, precision=lax.Precision.HIGHEST
        )
        logits = apply_soft_cap(logits * scale, soft_cap)
        logits = jnp.where(mask[:, None, None, :], logits, NEG_INF)
        rows = num_tokens * num_kv_heads * group
        p, corr, m_new, l_new = online_softmax_step(
            logits.reshape(rows, chunk_tokens), m.reshape(rows), denom.reshape(rows)
        )
        p = p.reshape(logits.shape)
        pv = jnp.einsum(
            "thgs,tshd->thgd",
            p,
            v.astype(jnp.float32),
            preferred_element_type=jnp.float32,
            precision=lax.Precision.HIGHEST,
        )
        acc = acc * corr.reshape(m.shape)[..., None] + pv
        return acc, m_new.reshape(m.shape), l_new.reshape(denom.shape)

    # Only walk as many chunks as the longest live sequence needs (dynamic trip count, no autodiff here).
    num_chunks = cdiv(jnp.max(kv_len, initial=0), chunk_tokens)
    init = (
        jnp.zeros((num_tokens, num_kv_heads, group, head_dim), jnp.float32),
        jnp.full((num_tokens, num_kv_heads, group), NEG_INF, jnp.float32),
        jnp.zeros((num_tokens, num_kv_heads, group), jnp.float32),
    )
    acc, _, denom = lax.fori_loop(0, num_chunks, body, init)
    out = acc / jnp.where(denom == 0.0, 1.0, denom)[..., None]
    out = jnp.where(valid[:, None, None, None], out, 0.0)
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)


def write_kv(
    k_pages: jax.Array,  # f[num_pages, page_size, Hkv, D], or as stored: f[num_pages, page_size, W >= Hkv * D]
    v_pages: jax.Array,  # the same shape as k_pages
    k: jax.Array,  # f[T, Hkv, D] new keys
    v: jax.Array,  # f[T, Hkv, D] new values
    slot_mapping: jax.Array,  # i32[T] flat slot = page * page_size + offset; < 0 or >= pool size: drop
) -> tuple[jax.Array, jax.Array]:  # updated (k_pages, v_pages)
    """Scatter new K/V into the pool.

    A single row-scatter on a free reshape of the pool (its two major axes merged, a token's heads one row): under
    ``jit`` with the pool donated XLA updates the buffer in place (no pool-sized copy). A stored pool's padding lanes
    (`common.pool_shape`) are written with zeros.
    """
    total = k_pages.shape[0] * k_pages.shape[1]
    slots = slot_mapping.astype(jnp.int32)
    # jnp indexing wraps negative indices before mode="drop" applies, so send them past the end explicitly.
    slots = jnp.where((slots >= 0) & (slots < total), slots, total)

    def scatter(pages: jax.Array, new: jax.Array) -> jax.Array:
        rows = pages.reshape(total, *pages.shape[2:])
        if rows.ndim == 2:  # stored rows: a token's heads side by side, zero-padded to the row's width
            new = new.reshape(new.shape[0], -1)
            new = jnp.pad(new, ((0, 0), (0, rows.shape[1] - new.shape[1])))
        rows = rows.at[slots].set(new.astype(pages.dtype), mode="drop")
        return rows.reshape(pages.shape)

    return scatter(k_pages, k), scatter(v_pages, v)
