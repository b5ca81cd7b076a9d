"""Paged decode attention for GPU: a Pallas kernel lowered through Triton (flash-decoding style).

Grid (batch, kv_head, kv_split). One program owns all G query heads of one KV head of one sequence, so
every K/V page is read from HBM once per KV head (GQA reuse) and the G rows form the M side of the
tensor-core dots. The page table is an ordinary input (Triton has no scalar prefetch); the program
walks its share of the row's pages in blocks of ``pages_per_block`` pages with an online softmax. With
num_splits > 1 the row's pages are divided between programs (more parallelism at small batch) and the
partial (acc, max, sum) triples are merged in XLA afterwards.
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
    check_pool_offsets,
    is_power_of_2,
    key_mask,
    next_power_of_2,
    online_softmax_step,
    safe_normalize,
)
from kernels_pallas.triton_compat import triton_call_kwargs

_SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
# tl.dot needs every operand dimension >= 16.
_MIN_DOT = 16
# Flash-decoding splits: one per this many KV blocks of the page-table width, at most _MAX_SPLITS. The count depends on
# the table's width only (a static engine setting), never on the batch: a row's KV is then divided the same way, and
# its softmax partials merged in the same order, whatever else is in the batch -- seeded outputs are batch invariant
# on GPU as on CPU. Each split writes f32 partials, so more splits cost merge traffic at large batch.
_BLOCKS_PER_SPLIT = 8
_MAX_SPLITS = 8


def check_supported(
    q: jax.Array,  # f[B, Hq, D]
    k_pages: jax.Array,  # f[num_pages, page_size, Hkv, D]
    v_pages: jax.Array,  # f[num_pages, page_size, Hkv, D]
    block_kv: int,
) -> None:
    """Static checks; raises UnsupportedCase so the dispatcher can fall through."""
    _, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_pages.shape
    if k_pages.shape != v_pages.shape:
        raise UnsupportedCase("k_pages and v_pages shapes differ")
    if num_q_heads % num_kv_heads:
        raise UnsupportedCase(f"num_q_heads={num_q_heads} not a multiple of num_kv_heads={num_kv_heads}")
    # Triton tensors must have power-of-2 extents; the dot needs >= 16 along the contraction.
    if not is_power_of_2(head_dim) or head_dim < _MIN_DOT:
        raise UnsupportedCase(f"head_dim={head_dim} must be a power of 2 >= {_MIN_DOT}")
    if not is_power_of_2(page_size):
        raise UnsupportedCase(f"page_size={page_size} must be a power of 2")
    if not is_power_of_2(block_kv) or max(block_kv, page_size) < _MIN_DOT:
        raise UnsupportedCase(f"block_kv={block_kv} must be a power of 2 with max(block_kv, page_size) >= 16")
    if not (q.dtype == k_pages.dtype == v_pages.dtype) or q.dtype not in _SUPPORTED_DTYPES:
        raise UnsupportedCase(f"dtypes q={q.dtype} k={k_pages.dtype} v={v_pages.dtype}")
    check_pool_offsets(k_pages)


def _decode_kernel(
    q_ref,  # f[G_pad, D]
    k_ref,  # f[num_pages, page_size, D] (this program's KV head)
    v_ref,  # f[num_pages, page_size, D]
    pt_ref,  # i32[P_pad] this row's page table
    len_ref,  # i32[1] this row's length
    *out_refs,  # split: acc f32[G_pad, D], m f32[G_pad], denom f32[G_pad]; else o f[G_pad, D]
    scale: float,
    soft_cap: float | None,
    sliding_window: int,
    page_size: int,
    pages_per_block: int,
    num_splits: int,
):
    block_tokens = pages_per_block * page_size
    rows, head_dim = q_ref.shape
    split = pl.program_id(2)
    length = len_ref[0]
    q = q_ref[...]

    # KV blocks this row needs: [first, last); with a window the leading blocks are skipped outright.
    last = cdiv(length, block_tokens)
    first = 0 if sliding_window <= 0 else jnp.maximum(length - sliding_window, 0) // block_tokens
    # Divide the row's own blocks (not the page-table width) evenly so short rows still use all splits.
    per_split = cdiv(jnp.maximum(last - first, 0), num_splits)
    lo = first + split * per_split
    hi = jnp.minimum(lo + per_split, last)
    pages_used = cdiv(length, page_size)

    def body(j, carry):
        acc, m, denom = carry
        page_idx = j * pages_per_block + jnp.arange(pages_per_block, dtype=jnp.int32)
        # Page-table slots past the last used page may be garbage; page 0 is a safe in-range stand-in
        # (its contents are masked below).
        ids = jnp.where(page_idx < pages_used, pt_ref[pl.ds(j * pages_per_block, pages_per_block)], 0)
        k = k_ref[ids].reshape(block_tokens, head_dim)
        v = v_ref[ids].reshape(block_tokens, head_dim)
        k_pos = j * block_tokens + jnp.arange(block_tokens, dtype=jnp.int32)
        logits = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        logits = apply_soft_cap(logits * scale, soft_cap)
        mask = key_mask(length - 1, k_pos[None, :], length, sliding_window)
        logits = jnp.where(mask, logits, NEG_INF)
        # Tail slots of the last page are unwritten (maybe NaN): p == 0 there, but 0 * NaN = NaN.
        v = jnp.where((k_pos < length)[:, None], v, jnp.zeros((), v.dtype))
        p, corr, m, denom = online_softmax_step(logits, m, denom)
        pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return acc * corr[:, None] + pv, m, denom

    init = (
        jnp.zeros((rows, head_dim), jnp.float32),
        jnp.full((rows,), NEG_INF, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )
    acc, m, denom = lax.fori_loop(lo, hi, body, init)

    if num_splits == 1:
        (o_ref,) = out_refs
        o_ref[...] = safe_normalize(acc, denom).astype(o_ref.dtype)
    else:
        acc_ref, m_ref, l_ref = out_refs
        acc_ref[...] = acc
        m_ref[...] = m
        l_ref[...] = denom


def _merge_splits(
    acc: jax.Array,  # f32[S, B, Hkv, G_pad, D] unnormalised partial outputs
    m: jax.Array,  # f32[S, B, Hkv, G_pad] partial maxima (-inf for empty splits)
    denom: jax.Array,  # f32[S, B, Hkv, G_pad] partial sums
) -> jax.Array:  # f32[B, Hkv, G_pad, D]
    m_all = jnp.max(m, axis=0)
    w = jnp.exp(m - jnp.where(m_all == NEG_INF, 0.0, m_all)[None])  # empty split: exp(-inf) = 0
    l_all = jnp.sum(w * denom, axis=0)
    acc_all = jnp.sum(w[..., None] * acc, axis=0)
    return acc_all / jnp.where(l_all == 0.0, 1.0, l_all)[..., None]


def default_num_splits(num_blocks: int) -> int:
    """Splits for a page table `num_blocks` KV blocks wide (independent of the batch size: see _BLOCKS_PER_SPLIT)."""
    return max(1, min(num_blocks // _BLOCKS_PER_SPLIT, _MAX_SPLITS))


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale",
        "sliding_window",
        "soft_cap",
        "block_kv",
        "num_splits",
        "num_warps",
        "num_stages",
        "interpret",
    ),
)
def paged_decode_attention(
    q: jax.Array,  # f[B, Hq, D]
    k_pages: jax.Array,  # f[num_pages, page_size, Hkv, D]
    v_pages: jax.Array,  # f[num_pages, page_size, Hkv, D]
    page_table: jax.Array,  # i32[B, pages_per_seq]
    lengths: jax.Array,  # i32[B]
    *,
    scale: float,
    sliding_window: int = 0,
    soft_cap: float | None = None,
    block_kv: int = 64,
    num_splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 3,  # benchmarks/sweep_decode_gpu.py on an H200: 3 stages +9-10% over 2 at context 2048
    interpret: bool = False,
) -> jax.Array:  # f[B, Hq, D]
    check_supported(q, k_pages, v_pages, block_kv)
    batch, num_q_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, _ = k_pages.shape
    group = num_q_heads // num_kv_heads
    rows = max(_MIN_DOT, next_power_of_2(group))  # dot M side; padded heads are zeros, sliced off

    pages_per_block = max(1, block_kv // page_size)
    pages_per_seq = page_table.shape[1]
    num_blocks = cdiv(pages_per_seq, pages_per_block)
    if num_splits is None:
        num_splits = default_num_splits(num_blocks)
    num_splits = max(1, min(num_splits, num_blocks))
    # Pad the table so a block's page-id load never runs past the row (padding ids are never used).
    padded_pages = num_blocks * pages_per_block
    page_table = jnp.pad(page_table.astype(jnp.int32), ((0, 0), (0, padded_pages - pages_per_seq)))

    qg = q.reshape(batch, num_kv_heads, group, head_dim)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, rows - group), (0, 0)))
    lengths2d = lengths.astype(jnp.int32).reshape(batch, 1)

    kernel = functools.partial(
        _decode_kernel,
        scale=scale,
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        page_size=page_size,
        pages_per_block=pages_per_block,
        num_splits=num_splits,
    )
    kv_spec = pl.BlockSpec((num_pages, page_size, None, head_dim), lambda b, h, s: (0, 0, h, 0))
    in_specs = [
        pl.BlockSpec((None, None, rows, head_dim), lambda b, h, s: (b, h, 0, 0)),
        kv_spec,
        kv_spec,
        pl.BlockSpec((None, padded_pages), lambda b, h, s: (b, 0)),
        pl.BlockSpec((None, 1), lambda b, h, s: (b, 0)),
    ]
    if num_splits == 1:
        out_shape = [jax.ShapeDtypeStruct((batch, num_kv_heads, rows, head_dim), q.dtype)]
        out_specs = [pl.BlockSpec((None, None, rows, head_dim), lambda b, h, s: (b, h, 0, 0))]
    else:
        part = (num_splits, batch, num_kv_heads, rows)
        out_shape = [
            jax.ShapeDtypeStruct((*part, head_dim), jnp.float32),
            jax.ShapeDtypeStruct(part, jnp.float32),
            jax.ShapeDtypeStruct(part, jnp.float32),
        ]
        out_specs = [
            pl.BlockSpec((None, None, None, rows, head_dim), lambda b, h, s: (s, b, h, 0, 0)),
            pl.BlockSpec((None, None, None, rows), lambda b, h, s: (s, b, h, 0)),
            pl.BlockSpec((None, None, None, rows), lambda b, h, s: (s, b, h, 0)),
        ]

    outs = pl.pallas_call(
        kernel,
        grid=(batch, num_kv_heads, num_splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
        name="paged_decode_attention_triton",
        **triton_call_kwargs(num_warps, num_stages),
    )(qg, k_pages, v_pages, page_table, lengths2d)

    out = outs[0] if num_splits == 1 else _merge_splits(*outs)
    return out[:, :, :group, :].reshape(batch, num_q_heads, head_dim).astype(q.dtype)
