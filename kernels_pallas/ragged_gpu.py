"""Ragged (chunked-prefill / mixed batch) paged attention for GPU: a Pallas kernel lowered via Triton.

Grid (query_block, kv_head). Query blocks are aligned to sequences: sequence i's q_len tokens are cut
into cdiv(q_len, block_q) blocks, so a block never straddles two sequences and its rows share one page
table row. The block -> (sequence, first token, first position) map is a few tiny XLA ops in the
wrapper (a searchsorted over the cumulative block counts); the grid is sized for the worst case
(cdiv(T, block_q) + max_seqs, capped at T) and unused blocks have zero rows, so they store nothing.

A block's rows are its block_q tokens x G_pad query heads of one KV head (GQA reuse of every K/V page
load); it walks the KV blocks its causal/window range needs with an online softmax.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels_pallas.common import (
    NEG_INF,
    UnsupportedCase,
    apply_soft_cap,
    cdiv,
    is_power_of_2,
    key_mask,
    next_power_of_2,
    online_softmax_step,
    safe_normalize,
)
from kernels_pallas.decode_gpu import check_supported as _check_decode_supported
from kernels_pallas.triton_compat import masked_store, triton_call_kwargs

_MIN_DOT = 16
# Columns of the per-block metadata array (padded to 8 to keep the row a power of 2).
_SEQ, _Q_START, _NUM_ROWS, _POS0, _KV_LEN = range(5)
_META_COLS = 8


def check_supported(
    q: jax.Array,  # f[T, Hq, D]
    k_pages: jax.Array,  # f[num_pages, page_size, Hkv, D]
    v_pages: jax.Array,  # f[num_pages, page_size, Hkv, D]
    block_q: int,
    block_kv: int,
) -> None:
    _check_decode_supported(q, k_pages, v_pages, block_kv)
    group = q.shape[1] // k_pages.shape[2]
    if not is_power_of_2(block_q) or block_q * next_power_of_2(group) < _MIN_DOT:
        raise UnsupportedCase(f"block_q={block_q} must be a power of 2 with block_q * G_pad >= 16")


def block_metadata(
    query_start_loc: jax.Array,  # i32[max_seqs + 1]
    context_lens: jax.Array,  # i32[max_seqs]
    num_seqs: jax.Array,  # i32[]
    num_tokens: int,
    block_q: int,
) -> jax.Array:  # i32[num_blocks, 8]: seq, q_start, num_rows, pos0, kv_len, 0, 0, 0
    max_seqs = context_lens.shape[0]
    live = jnp.arange(max_seqs, dtype=jnp.int32) < num_seqs
    q_lens = jnp.where(live, query_start_loc[1:] - query_start_loc[:-1], 0)
    blocks = cdiv(q_lens, block_q)
    ends = jnp.cumsum(blocks)  # non-decreasing; block g belongs to the first seq with ends > g
    # Each non-empty block holds >= 1 token, and sum_i cdiv(q_len_i, bq) <= T / bq + num_seqs.
    num_blocks = max(1, min(num_tokens, cdiv(num_tokens, block_q) + max_seqs))
    g = jnp.arange(num_blocks, dtype=jnp.int32)
    # compare_all: one fused compare-and-sum. The default binary search is a while loop, which on the H200 ran as a
    # host-driven loop outside XLA's command buffers, in every mixed step.
    seq = jnp.searchsorted(ends, g, side="right", method="compare_all").astype(jnp.int32)
    seq = jnp.minimum(seq, max_seqs - 1)
    used = g < ends[-1]
    qblk = g - (ends[seq] - blocks[seq])
    num_rows = jnp.where(used, jnp.minimum(block_q, q_lens[seq] - qblk * block_q), 0)
    q_start = jnp.where(used, query_start_loc[seq] + qblk * block_q, 0)
    pos0 = jnp.where(used, context_lens[seq] - q_lens[seq] + qblk * block_q, 0)
    kv_len = jnp.where(used, context_lens[seq], 0)
    zeros = jnp.zeros_like(g)
    return jnp.stack([seq, q_start, num_rows, pos0, kv_len, zeros, zeros, zeros], axis=1).astype(jnp.int32)


def _ragged_kernel(
    meta_ref,  # i32[8] this block's metadata
    q_ref,  # f[T_pad, G_pad, D] (this program's KV head)
    k_ref,  # f[num_pages, page_size, D]
    v_ref,  # f[num_pages, page_size, D]
    pt_ref,  # i32[max_seqs, P_pad]
    o_ref,  # f[T_pad, G_pad, D]
    *,
    scale: float,
    soft_cap: float | None,
    sliding_window: int,
    block_q: int,
    page_size: int,
    pages_per_block: int,
):
    _, g_pad, head_dim = q_ref.shape
    rows = block_q * g_pad
    block_tokens = pages_per_block * page_size
    seq = meta_ref[_SEQ]
    q_start = meta_ref[_Q_START]
    num_rows = meta_ref[_NUM_ROWS]
    pos0 = meta_ref[_POS0]
    kv_len = meta_ref[_KV_LEN]

    q = q_ref[pl.ds(q_start, block_q)].reshape(rows, head_dim)
    row_tok = jnp.arange(rows, dtype=jnp.int32) // g_pad  # token index of each row inside the block
    q_pos = pos0 + row_tok

    # Keys any valid row of this block can see: [kv_lo, kv_hi).
    kv_hi = jnp.minimum(pos0 + num_rows, kv_len)
    kv_lo = 0 if sliding_window <= 0 else jnp.maximum(pos0 - sliding_window + 1, 0)
    pages_used = cdiv(kv_len, page_size)

    def body(j, carry):
        acc, m, denom = carry
        page_idx = j * pages_per_block + jnp.arange(pages_per_block, dtype=jnp.int32)
        # Slots past the sequence's last used page may be garbage: read page 0 instead (masked below).
        ids = jnp.where(page_idx < pages_used, pt_ref[seq, pl.ds(j * pages_per_block, pages_per_block)], 0)
        k = k_ref[ids].reshape(block_tokens, head_dim)
        v = v_ref[ids].reshape(block_tokens, head_dim)
        k_pos = j * block_tokens + jnp.arange(block_tokens, dtype=jnp.int32)
        logits = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        logits = apply_soft_cap(logits * scale, soft_cap)
        logits = jnp.where(key_mask(q_pos[:, None], k_pos[None, :], kv_len, sliding_window), logits, NEG_INF)
        # Unwritten tail slots may hold NaN; p == 0 there but 0 * NaN = NaN, so zero V itself.
        v = jnp.where((k_pos < kv_len)[:, None], v, jnp.zeros((), v.dtype))
        p, corr, m, denom = online_softmax_step(logits, m, denom)
        pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return acc * corr[:, None] + pv, m, denom

    init = (
        jnp.zeros((rows, head_dim), jnp.float32),
        jnp.full((rows,), NEG_INF, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )
    acc, _, denom = lax.fori_loop(kv_lo // block_tokens, cdiv(kv_hi, block_tokens), body, init)
    out = safe_normalize(acc, denom).astype(o_ref.dtype).reshape(block_q, g_pad, head_dim)
    # Rows past num_rows belong to the next sequence's block (or to nobody): never write them.
    keep = jnp.broadcast_to((jnp.arange(block_q) < num_rows)[:, None, None], out.shape)
    masked_store(o_ref.at[pl.ds(q_start, block_q)], out, keep)


def default_block_q(group: int, target_rows: int = 64) -> int:
    return max(1, target_rows // next_power_of_2(group))


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale",
        "sliding_window",
        "soft_cap",
        "block_q",
        "block_kv",
        "num_warps",
        "num_stages",
        "interpret",
    ),
)
def ragged_paged_attention(
    q: jax.Array,  # f[T, Hq, D] packed query tokens
    k_pages: jax.Array,  # f[num_pages, page_size, Hkv, D]
    v_pages: jax.Array,  # f[num_pages, page_size, Hkv, D]
    page_table: jax.Array,  # i32[max_seqs, pages_per_seq]
    context_lens: jax.Array,  # i32[max_seqs] KV length incl. new tokens
    query_start_loc: jax.Array,  # i32[max_seqs + 1]
    num_seqs: jax.Array,  # i32[] or i32[1]
    *,
    scale: float,
    sliding_window: int = 0,
    soft_cap: float | None = None,
    block_q: int | None = None,
    block_kv: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
) -> jax.Array:  # f[T, Hq, D]
    num_tokens, num_q_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, _ = k_pages.shape
    group = num_q_heads // num_kv_heads
    g_pad = next_power_of_2(group)
    if block_q is None:
        block_q = default_block_q(group)
    check_supported(q, k_pages, v_pages, block_q, block_kv)
    num_seqs = jnp.asarray(num_seqs, jnp.int32).reshape(())
    query_start_loc = query_start_loc.astype(jnp.int32)
    context_lens = context_lens.astype(jnp.int32)

    meta = block_metadata(query_start_loc, context_lens, num_seqs, num_tokens, block_q)
    num_blocks = meta.shape[0]

    pages_per_block = max(1, block_kv // page_size)
    pages_per_seq = page_table.shape[1]
    padded_pages = cdiv(pages_per_seq, pages_per_block) * pages_per_block
    page_table = jnp.pad(page_table.astype(jnp.int32), ((0, 0), (0, padded_pages - pages_per_seq)))

    # block_q spare rows at the end so a block's fixed-size q load/store never leaves the array.
    padded_tokens = num_tokens + block_q
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    qg = jnp.pad(qg, ((0, block_q), (0, 0), (0, g_pad - group), (0, 0)))

    kernel = functools.partial(
        _ragged_kernel,
        scale=scale,
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        block_q=block_q,
        page_size=page_size,
        pages_per_block=pages_per_block,
    )
    tok_spec = pl.BlockSpec((padded_tokens, None, g_pad, head_dim), lambda i, h: (0, h, 0, 0))
    kv_spec = pl.BlockSpec((num_pages, page_size, None, head_dim), lambda i, h: (0, 0, h, 0))
    out = pl.pallas_call(
        kernel,
        grid=(num_blocks, num_kv_heads),
        in_specs=[
            pl.BlockSpec((None, _META_COLS), lambda i, h: (i, 0)),
            tok_spec,
            kv_spec,
            kv_spec,
            pl.BlockSpec(page_table.shape, lambda i, h: (0, 0)),
        ],
        out_specs=tok_spec,
        out_shape=jax.ShapeDtypeStruct((padded_tokens, num_kv_heads, g_pad, head_dim), q.dtype),
        interpret=interpret,
        name="ragged_paged_attention_triton",
        **triton_call_kwargs(num_warps, num_stages),
    )(meta, qg, k_pages, v_pages, page_table)

    out = out[:num_tokens, :, :group, :].reshape(num_tokens, num_q_heads, head_dim)
    # Padding tokens are written by no block (their memory is uninitialised): zero them here.
    valid = jnp.arange(num_tokens) < query_start_loc[jnp.clip(num_seqs, 0, context_lens.shape[0])]
    return jnp.where(valid[:, None, None], out, jnp.zeros((), out.dtype))
