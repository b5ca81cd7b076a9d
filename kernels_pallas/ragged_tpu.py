"""Ragged (chunked-prefill / mixed batch) paged attention for TPU: Pallas/Mosaic with scalar prefetch.

Same signature and semantics as ``reference.ragged_paged_attention``: the query tokens of several
sequences are packed on one token axis; sequence i's tokens sit at positions ``context_len - q_len ...``
and attend causally to its cached prefix (in the paged pool) plus its own earlier new tokens.

Tiling
------
Grid (query block,). As in ``ragged_gpu``, query blocks are aligned to sequences: sequence i's q_len
tokens are cut into cdiv(q_len, block_q) blocks, so a block never straddles two sequences and all its
rows read one page-table row. The block -> (sequence, offset in the sequence) map is a few tiny XLA
ops (a searchsorted over the cumulative block counts); the grid is sized for the worst case
(cdiv(T, block_q) + max_seqs, capped at T) and the unused tail blocks do no work.

One grid step handles every head of its block. Rows are ``G * block_q`` (GQA: the G query heads of one
KV head times the block's tokens, head-major), so each K/V tile loaded is reused by all G heads. The
wrapper gathers the block's tokens into that layout with one XLA gather, [NB, Hkv, G * block_q, W],
which also lets the kernel skip any in-kernel transposes; the output comes back the same way and is
scattered to the packed token axis (padding tokens -> zeros).

KV: the pools stay in HBM (``memory_space=pl.ANY``) as the engine stores them, [num_pages, page_size, W]
(``common.pool_shape``: a token's heads side by side, W = Hkv * D padded to whole 128-lane rows on a TPU).
A step fetches ``pages_per_step`` whole pages of K and V (every head: one contiguous DMA per page) into
a double-buffered VMEM scratch, and head h is the lane slice [h * D, (h + 1) * D) -- 128-lane aligned
when D % 128 == 0, so no relayout. (D == 64: see "lane windows" below.) Only the steps the block's
causal / sliding-window range needs are walked (a dynamic-trip-count loop, no idle grid steps), and
pages past the sequence's last used page are never fetched (their page-table entries may be garbage).

Pipelining: while step j is computed, step j + 1 is in flight into the other buffer. On a block's last
step the first step of the *next* grid block is started instead, so the DMA latency at block boundaries
is hidden too (decode-heavy batches are one short block per sequence). The buffer parity carries across
grid steps in an SMEM scratch word, which is why the grid axis is "arbitrary" (sequential).

Scalar prefetch (SMEM): per-block sequence ids and offsets, the flattened page table, context_lens,
query_start_loc and num_seqs. DMA addresses and masks are computed from them on the scalar core.

Lane windows (D == 64 with Hkv > 1): a 64-lane slice at lane offset 64 is not tile aligned, so head h
reads the aligned 128-lane window holding heads (2 * (h // 2), 2 * (h // 2) + 1), and the wrapper places
its queries in the matching half of a 128-lane query with zeros in the other half: q_w . k_window ==
q . k_h exactly. p @ v_window yields head h's output in that half (the other half is discarded). This
spends 2x the MXU flops of a 64-wide dot to keep every vector access lane aligned. With an odd Hkv (the
default model: 3 KV heads of 64) the last head has no partner: a 128-lane window would run past the pool
row, so it reads its own 64 lanes (a 128-aligned start) and dots them with the first half of its query
window; its output lands in that half, as for any even head.

Costs / limits: the grid axis is sequential (no megacore split on v4/v5p); the whole page table sits in
SMEM (max_seqs * pages_per_seq words); a decode token still computes a whole G * block_q-row tile (the
step is DMA-bound anyway); the first KV step of grid step 0 is not overlapped. Only verified here in
interpret mode and by lowering to Mosaic MLIR (no TPU available): Mosaic compilation, on-device numerics
and performance are untested; see README.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas.common import (
    NEG_INF,
    SMEM_BUDGET_WORDS,
    UnsupportedCase,
    apply_soft_cap,
    cdiv,
    check_pool_offsets,
    is_power_of_2,
    key_mask,
    next_power_of_2,
    rows_as_heads,
    rows_view,
)
from kernels_pallas.reference import token_layout

_SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16)
_LANES = 128
# Rows of a (sublane, lane) VMEM tile per itemsize: a page slot inside a multi-page buffer must start on
# a tile row, so several pages per step need page_size to be a multiple of this.
_SUBLANE_TILE = {4: 8, 2: 16}
# KV tokens per step the defaults aim for (one 128-wide MXU pass for q @ k^T), and the VMEM the kernel's
# buffers may use (v5e's default scoped VMEM limit is 16 MiB; leave headroom for Mosaic's temporaries).
_TARGET_KV_TOKENS = 128
_TARGET_Q_ROWS = 128
_VMEM_BUDGET = 12 * 1024 * 1024
# The scoped VMEM limit passed to Mosaic (v5e's default is 16 MiB; every generation since v4 has at least that).
VMEM_LIMIT_BYTES = 16 * 1024 * 1024


def lane_window(head_dim: int, num_kv_heads: int) -> int:
    """Lanes of the KV-pool slice one head's dot reads (see "lane windows" in the module docstring)."""
    if head_dim % _LANES == 0 or num_kv_heads == 1:
        return head_dim  # aligned, or the whole row
    return _LANES


def check_supported(
    q: jax.Array,  # f[T, Hq, D]
    k_pages: jax.Array,  # f[num_pages, page_size, Hkv, D]
    v_pages: jax.Array,  # f[num_pages, page_size, Hkv, D]
    page_table: jax.Array | None = None,  # i32[max_seqs, pages_per_seq]; None: the SMEM check is skipped
    block_q: int | None = None,
    pages_per_step: int | None = None,
) -> None:
    num_tokens, num_q_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, _ = k_pages.shape
    if k_pages.shape != v_pages.shape:
        raise UnsupportedCase("k_pages and v_pages shapes differ")
    if num_q_heads % num_kv_heads:
        raise UnsupportedCase(f"num_q_heads={num_q_heads} not a multiple of num_kv_heads={num_kv_heads}")
    if not (q.dtype == k_pages.dtype == v_pages.dtype) or q.dtype not in _SUPPORTED_DTYPES:
        raise UnsupportedCase(f"dtypes q={q.dtype} k={k_pages.dtype} v={v_pages.dtype}")
    if head_dim % _LANES and head_dim != 64:
        raise UnsupportedCase(f"head_dim={head_dim} not a multiple of 128 (or 64)")
    check_pool_offsets(k_pages)
    bq, _ = block_sizes(q, k_pages, None, block_q, pages_per_step)
    if page_table is not None:
        max_seqs, pages_per_seq = page_table.shape
        blocks = max(1, min(num_tokens, cdiv(num_tokens, bq) + max_seqs))
        # Scalar prefetch: block seq ids and offsets, page table, context_lens, query_start_loc, num_seqs.
        words = 2 * blocks + max_seqs * pages_per_seq + 2 * max_seqs + 2
        if words > SMEM_BUDGET_WORDS:
            raise UnsupportedCase(f"SMEM: the scalar-prefetched tables take {words} words > {SMEM_BUDGET_WORDS}")


def block_sizes(
    q: jax.Array,  # f[T, Hq, D]
    k_pages: jax.Array,  # f[num_pages, page_size, Hkv, D]
    pages_per_seq: int | None,  # caps the default pages_per_step (None: unknown, no cap)
    block_q: int | None,
    pages_per_step: int | None,
) -> tuple[int, int]:  # (block_q, pages_per_step)
    """Explicit sizes are validated; defaults aim at ~128 query rows and ~128 KV tokens per step and
    are halved (KV step first) until the kernel's VMEM estimate fits the budget."""
    num_tokens, num_q_heads, _ = q.shape
    _, page_size, num_kv_heads, _ = k_pages.shape
    group = num_q_heads // num_kv_heads
    tile = _SUBLANE_TILE[q.dtype.itemsize]
    if block_q is not None and not is_power_of_2(block_q):
        raise UnsupportedCase(f"block_q={block_q} must be a power of 2")
    if pages_per_step is not None and pages_per_step > 1 and page_size % tile:
        # Page i of a step lands at buffer row i * page_size, which must start a (sublane, lane) tile.
        raise UnsupportedCase(f"pages_per_step > 1 needs page_size % {tile} == 0")
    bq = block_q or max(1, min(_TARGET_Q_ROWS // next_power_of_2(group), next_power_of_2(num_tokens)))
    if pages_per_step:
        pps = pages_per_step
    elif page_size % tile:
        pps = 1  # pages can't be stacked tile-aligned in one buffer: one page per step
    else:
        pps = max(1, min(_TARGET_KV_TOKENS // page_size, pages_per_seq or _TARGET_KV_TOKENS))
    while _vmem_bytes(q, k_pages, bq, pps) > _VMEM_BUDGET:
        if pages_per_step is None and pps > 1:
            pps //= 2
        elif block_q is None and bq > 1:
            bq //= 2
        else:
            raise UnsupportedCase(f"VMEM: query block / KV step buffers exceed the {_VMEM_BUDGET}-byte budget")
    return bq, pps


def _vmem_bytes(q: jax.Array, k_pages: jax.Array, block_q: int, pages_per_step: int) -> int:
    _, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_pages.shape
    rows = block_q * (num_q_heads // num_kv_heads)
    width = lane_window(head_dim, num_kv_heads)
    size = q.dtype.itemsize
    kv_tokens = pages_per_step * page_size
    q_and_out = 2 * 2 * num_kv_heads * rows * width * size  # double-buffered by the Pallas pipeline
    kv = 2 * 2 * kv_tokens * cdiv(num_kv_heads * head_dim, _LANES) * _LANES * size  # K and V, two slots each
    state = num_kv_heads * rows * (width + 2 * _LANES) * 4  # acc, m, l (lane-padded) in f32
    temps = 4 * rows * max(kv_tokens, _LANES) * 4  # logits / p tiles and friends
    return q_and_out + kv + state + temps


def block_schedule(
    query_start_loc: jax.Array,  # i32[max_seqs + 1]
    num_seqs: jax.Array,  # i32[]
    num_tokens: int,
    block_q: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Sequence-aligned query blocks: (seq i32[NB] (max_seqs for unused blocks), first token's offset in
    its sequence i32[NB], first block of each sequence i32[max_seqs])."""
    max_seqs = query_start_loc.shape[0] - 1
    live = jnp.arange(max_seqs, dtype=jnp.int32) < num_seqs
    q_lens = jnp.where(live, jnp.maximum(query_start_loc[1:] - query_start_loc[:-1], 0), 0)
    blocks = cdiv(q_lens, block_q)
    ends = jnp.cumsum(blocks)  # block g belongs to the first sequence with ends > g
    # Each used block holds >= 1 token, and sum_i cdiv(q_len_i, bq) <= T / bq + max_seqs.
    num_blocks = max(1, min(num_tokens, cdiv(num_tokens, block_q) + max_seqs))
    g = jnp.arange(num_blocks, dtype=jnp.int32)
    # compare_all: one fused compare-and-sum. The default binary search is a while loop, which on the H200 ran as a
    # host-driven loop outside XLA's command buffers, in every mixed step.
    seq = jnp.searchsorted(ends, g, side="right", method="compare_all").astype(jnp.int32)
    seq = jnp.minimum(seq, max_seqs - 1)
    first_block = ends - blocks
    used = g < ends[-1]
    q_off = jnp.where(used, (g - first_block[seq]) * block_q, 0)
    return jnp.where(used, seq, max_seqs), q_off, first_block


def _start_all(copies) -> None:
    for copy in copies:
        copy.start()


def _wait_all(copies) -> None:
    for copy in copies:
        copy.wait()


def _ragged_kernel(
    # Scalar prefetch (SMEM).
    blk_seq_ref,  # i32[NB] sequence of each query block (>= num_seqs: unused block)
    blk_off_ref,  # i32[NB] offset of the block's first token inside its sequence
    page_table_ref,  # i32[max_seqs * pages_per_seq]
    context_lens_ref,  # i32[max_seqs]
    query_start_loc_ref,  # i32[max_seqs + 1]
    num_seqs_ref,  # i32[1]
    # Inputs.
    q_ref,  # VMEM f[Hkv, G * block_q, W] this block's queries (head-major rows)
    k_hbm,  # HBM f[num_pages, page_size, W >= Hkv * D]
    v_hbm,  # HBM f[num_pages, page_size, W]
    # Output.
    o_ref,  # VMEM f[Hkv, G * block_q, W]
    # Scratch.
    k_buf,  # VMEM f[2, kv_tokens, W] double-buffered KV step
    v_buf,  # VMEM f[2, kv_tokens, W]
    sems,  # DMA semaphores [2 (k/v), 2 (slot)]
    slot_ref,  # SMEM i32[1] buffer slot of this block's first KV step (carried across grid steps)
    m_ref,  # VMEM f32[Hkv, G * block_q, 1] running max
    l_ref,  # VMEM f32[Hkv, G * block_q, 1] running sum
    acc_ref,  # VMEM f32[Hkv, G * block_q, W] running numerator
    *,
    scale: float,
    soft_cap: float | None,
    sliding_window: int,
    block_q: int,
    page_size: int,
    pages_per_step: int,
    pages_per_seq: int,
    head_dim: int,
):
    num_kv_heads, rows, width = q_ref.shape
    kv_tokens = pages_per_step * page_size
    max_seqs = context_lens_ref.shape[0]
    num_pages = k_hbm.shape[0]
    g, num_blocks = pl.program_id(0), pl.num_programs(0)  # query block

    def block_info(b):
        """Scalars describing query block b (any b in [0, num_blocks))."""
        seq_raw = blk_seq_ref[b]
        seq = jnp.minimum(seq_raw, max_seqs - 1)  # unused blocks: any valid row, masked by `live`
        q_len = query_start_loc_ref[seq + 1] - query_start_loc_ref[seq]
        kv_len = context_lens_ref[seq]
        q_off = blk_off_ref[b]
        num_rows = jnp.clip(q_len - q_off, 0, block_q)
        pos0 = kv_len - q_len + q_off  # absolute position of the block's first query token
        live = (seq_raw < num_seqs_ref[0]) & (num_rows > 0)
        # Keys any row of the block can see: [kv_lo, kv_hi).
        kv_hi = jnp.minimum(pos0 + num_rows, kv_len)
        kv_lo = 0 if sliding_window <= 0 else jnp.maximum(pos0 - sliding_window + 1, 0)
        first = kv_lo // kv_tokens
        num_steps = jnp.where(live, jnp.maximum(cdiv(kv_hi, kv_tokens) - first, 0), 0)
        return dict(seq=seq, kv_len=kv_len, pos0=pos0, first=first, num_steps=num_steps)

    def kv_copies(info, step, slot):
        """(needed, (K copy, V copy)) per page of one KV step; pages past the sequence's end are skipped."""
        used_pages = cdiv(info["kv_len"], page_size)
        for i in range(pages_per_step):
            page = step * pages_per_step + i
            page_id = page_table_ref[info["seq"] * pages_per_seq + jnp.minimum(page, pages_per_seq - 1)]
            page_id = jnp.clip(page_id, 0, num_pages - 1)  # only matters for skipped (garbage) entries
            dst = pl.ds(i * page_size, page_size)
            k_copy = pltpu.make_async_copy(k_hbm.at[page_id], k_buf.at[slot, dst], sems.at[0, slot])
            v_copy = pltpu.make_async_copy(v_hbm.at[page_id], v_buf.at[slot, dst], sems.at[1, slot])
            yield page < used_pages, (k_copy, v_copy)

    def start_step(info, step, slot):
        for needed, copies in kv_copies(info, step, slot):
            pl.when(needed)(functools.partial(_start_all, copies))

    def wait_step(info, step, slot):
        # Rebuilds the same descriptors (same predicate, destination and semaphore) as the start.
        for needed, copies in kv_copies(info, step, slot):
            pl.when(needed)(functools.partial(_wait_all, copies))

    cur = block_info(g)
    has_next = g + 1 < num_blocks
    nxt = block_info(jnp.minimum(g + 1, num_blocks - 1))
    nxt_steps = jnp.where(has_next, nxt["num_steps"], 0)

    @pl.when(g == 0)
    def _first_block():
        slot_ref[0] = 0

    slot0 = slot_ref[0]
    # The previous grid step started this block's first KV step iff both blocks have work (the same
    # predicate it used, recomputed here); otherwise start it now.
    prev = block_info(jnp.maximum(g - 1, 0))
    prefetched = (g > 0) & (prev["num_steps"] > 0)

    @pl.when((cur["num_steps"] > 0) & jnp.logical_not(prefetched))
    def _start_first():
        start_step(cur, cur["first"], slot0)

    m_ref[...] = jnp.full(m_ref.shape, NEG_INF, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    # Static per-tile index grids (built at full shape: int compares only, no i1 broadcasts for Mosaic).
    # Rows are head-major (row = head_in_group * block_q + t); block_q is a power of 2, so the token
    # index t = row & (block_q - 1) needs no vector division.
    row_tok = lax.broadcasted_iota(jnp.int32, (rows, kv_tokens), 0) & (block_q - 1)
    col = lax.broadcasted_iota(jnp.int32, (rows, kv_tokens), 1)
    v_row = lax.broadcasted_iota(jnp.int32, (kv_tokens, width), 0)
    heads_per_window = width // head_dim

    def step_body(j, carry):
        step = cur["first"] + j
        slot = (slot0 + j) % 2
        other = 1 - slot

        # Keep the DMA engine busy while this step computes: fetch this block's next step into the other
        # slot or, on its last step, the next block's first step.
        more = j + 1 < cur["num_steps"]
        target = {key: jnp.where(more, cur[key], nxt[key]) for key in ("seq", "kv_len")}

        @pl.when(more | (nxt_steps > 0))
        def _prefetch():
            start_step(target, jnp.where(more, step + 1, nxt["first"]), other)

        wait_step(cur, step, slot)

        k_start = step * kv_tokens
        q_pos = cur["pos0"] + row_tok
        mask = key_mask(q_pos, k_start + col, cur["kv_len"], sliding_window)
        # Unwritten tail slots and skipped pages may hold NaN/stale data: p == 0 there, but 0 * NaN = NaN,
        # so zero V itself. (K needs nothing: its logits are replaced by -inf with a select.)
        v_ok = v_row < cur["kv_len"] - k_start
        for h in range(num_kv_heads):
            # The unpaired last head of an odd Hkv (D == 64) reads only its own 64 lanes (see the docstring).
            lone = heads_per_window > 1 and h == num_kv_heads - 1 and num_kv_heads % 2 == 1
            w = head_dim if lone else width
            lanes = pl.ds((h // heads_per_window) * width, w)  # static, 128-aligned (or whole row)
            k = k_buf[slot, :, lanes]  # f[kv_tokens, w]
            v = v_buf[slot, :, lanes]
            q = q_ref[h][:, :w] if lone else q_ref[h]
            logits = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            logits = apply_soft_cap(logits * scale, soft_cap)
            logits = jnp.where(mask, logits, NEG_INF)  # f32[rows, kv_tokens]

            m_prev, l_prev = m_ref[h], l_ref[h]
            m_next = jnp.maximum(m_prev, jnp.max(logits, axis=-1, keepdims=True))
            m_safe = jnp.where(m_next == NEG_INF, 0.0, m_next)  # rows with no key yet: exp(-inf) = 0
            p = jnp.exp(logits - m_safe)
            corr = jnp.exp(m_prev - m_safe)
            l_ref[h] = corr * l_prev + jnp.sum(p, axis=-1, keepdims=True)
            m_ref[h] = m_next
            v = jnp.where(v_ok[:, :w], v, jnp.zeros((), v.dtype))
            pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
            acc = acc_ref.at[h, :, pl.ds(0, w)]  # a lone head fills the first half; the rest stays zero
            acc[...] = acc[...] * corr + pv
        return carry

    lax.fori_loop(0, cur["num_steps"], step_body, 0)
    slot_ref[0] = (slot0 + cur["num_steps"]) % 2  # the slot the next block's first step went to

    for h in range(num_kv_heads):
        denom = l_ref[h]
        # Rows that saw no key (unused blocks, rows past the block's tokens) have acc == 0: zeros, not NaN.
        o_ref[h] = (acc_ref[h] / jnp.where(denom == 0.0, 1.0, denom)).astype(o_ref.dtype)


def ragged_paged_attention(
    q: jax.Array,  # f[T, Hq, D] packed query tokens
    k_pages: jax.Array,  # f[num_pages, page_size, Hkv, D] (new tokens' K/V already written)
    v_pages: jax.Array,  # f[num_pages, page_size, Hkv, D]
    *tables: jax.Array,  # page_table, context_lens, query_start_loc, num_seqs
    **kw,
) -> jax.Array:  # f[T, Hq, D], zeros for padding tokens
    """The kernel on [.., Hkv, D] pools (a free reshape to rows); see `ragged_paged_attention_rows`."""
    return ragged_paged_attention_rows(
        q, rows_view(k_pages), rows_view(v_pages), *tables, num_kv_heads=k_pages.shape[2], **kw
    )


@functools.partial(
    jax.jit,
    static_argnames=("num_kv_heads", "scale", "sliding_window", "soft_cap", "block_q", "pages_per_step", "interpret"),
)
def ragged_paged_attention_rows(
    q: jax.Array,  # f[T, Hq, D] packed query tokens
    k_rows: jax.Array,  # f[num_pages, page_size, W]: a pool as stored (common.pool_shape), W >= Hkv * D
    v_rows: jax.Array,  # f[num_pages, page_size, W]
    page_table: jax.Array,  # i32[max_seqs, pages_per_seq]
    context_lens: jax.Array,  # i32[max_seqs] KV length incl. the new tokens
    query_start_loc: jax.Array,  # i32[max_seqs + 1]
    num_seqs: jax.Array,  # i32[] or i32[1]
    *,
    num_kv_heads: int,
    scale: float,
    sliding_window: int = 0,
    soft_cap: float | None = None,
    block_q: int | None = None,
    pages_per_step: int | None = None,
    interpret: bool | pltpu.InterpretParams = False,
) -> jax.Array:  # f[T, Hq, D], zeros for padding tokens
    """``block_q``: query tokens per block (power of 2); ``pages_per_step``: KV pages per DMA/compute step.
    ``interpret``: True for the generic Pallas interpreter, or ``pltpu.InterpretParams()`` for the
    TPU-faithful one (simulated DMAs/semaphores, stricter bounds)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_pages, page_size, row_width = k_rows.shape
    k_pages, v_pages = rows_as_heads(k_rows, v_rows, num_kv_heads, head_dim)  # the shapes the checks read
    check_supported(q, k_pages, v_pages, page_table, block_q, pages_per_step)
    group = num_q_heads // num_kv_heads
    max_seqs, pages_per_seq = page_table.shape
    block_q, pages_per_step = block_sizes(q, k_pages, pages_per_seq, block_q, pages_per_step)
    if num_tokens == 0:
        return jnp.zeros_like(q)
    rows = group * block_q
    width = lane_window(head_dim, num_kv_heads)
    heads_per_window = width // head_dim

    num_seqs = jnp.asarray(num_seqs, jnp.int32).reshape(())
    context_lens = context_lens.astype(jnp.int32)
    query_start_loc = query_start_loc.astype(jnp.int32)
    blk_seq, blk_off, first_block = block_schedule(query_start_loc, num_seqs, num_tokens, block_q)
    num_blocks = blk_seq.shape[0]

    # Gather each block's tokens into [NB, Hkv, G * block_q, W] (rows past the block's tokens -> 0).
    seq_c = jnp.minimum(blk_seq, max_seqs - 1)
    q_len = query_start_loc[seq_c + 1] - query_start_loc[seq_c]
    t = jnp.arange(block_q, dtype=jnp.int32)
    tok = query_start_loc[seq_c][:, None] + blk_off[:, None] + t  # [NB, block_q]
    row_ok = (blk_seq < max_seqs)[:, None] & (blk_off[:, None] + t < q_len[:, None])
    qb = jnp.take(q, jnp.clip(tok, 0, num_tokens - 1), axis=0)  # [NB, bq, Hq, D]
    qb = jnp.where(row_ok[:, :, None, None], qb, jnp.zeros((), q.dtype))
    qb = qb.reshape(num_blocks, block_q, num_kv_heads, group, head_dim).transpose(0, 2, 3, 1, 4)
    if heads_per_window > 1:
        # Head h's queries go in lane slot h % heads_per_window of its window, zeros elsewhere.
        slot_of = jnp.arange(num_kv_heads)[:, None] % heads_per_window == jnp.arange(heads_per_window)[None, :]
        qb = jnp.where(slot_of[None, :, None, None, :, None], qb[:, :, :, :, None, :], jnp.zeros((), q.dtype))
    qb = qb.reshape(num_blocks, num_kv_heads, rows, width)

    kernel = functools.partial(
        _ragged_kernel,
        scale=scale,
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        block_q=block_q,
        page_size=page_size,
        pages_per_step=pages_per_step,
        pages_per_seq=pages_per_seq,
        head_dim=head_dim,
    )
    kv_tokens = pages_per_step * page_size
    block_spec = pl.BlockSpec((None, num_kv_heads, rows, width), lambda b, *_: (b, 0, 0, 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=6,
        grid=(num_blocks,),
        in_specs=[block_spec, pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=block_spec,
        scratch_shapes=[
            pltpu.VMEM((2, kv_tokens, row_width), k_rows.dtype),
            pltpu.VMEM((2, kv_tokens, row_width), v_rows.dtype),
            pltpu.SemaphoreType.DMA((2, 2)),
            pltpu.SMEM((1,), jnp.int32),
            pltpu.VMEM((num_kv_heads, rows, 1), jnp.float32),
            pltpu.VMEM((num_kv_heads, rows, 1), jnp.float32),
            pltpu.VMEM((num_kv_heads, rows, width), jnp.float32),
        ],
    )
    out = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((num_blocks, num_kv_heads, rows, width), q.dtype),
        # Sequential: a block prefetches the next block's first KV step and hands over the buffer slot.
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",), vmem_limit_bytes=VMEM_LIMIT_BYTES),
        interpret=interpret,
        name="ragged_paged_attention_tpu",
    )(
        blk_seq,
        blk_off,
        # 1-D in SMEM: 2-D SMEM arrays are padded to (8, 128) tiles.
        page_table.astype(jnp.int32).reshape(-1),
        context_lens,
        query_start_loc,
        num_seqs.reshape(1),
        qb,
        # A page row holds every head, head h in lanes [h * D, (h + 1) * D) (then the row's padding, if any).
        k_rows,
        v_rows,
    )

    # Back to the packed token axis: token t of sequence s at offset j is row j % bq of block
    # first_block[s] + j // bq.
    out = out.reshape(num_blocks, num_kv_heads, group, block_q, heads_per_window, head_dim)
    out = jnp.stack([out[:, h, :, :, h % heads_per_window] for h in range(num_kv_heads)], axis=1)
    out = out.transpose(0, 3, 1, 2, 4).reshape(num_blocks * block_q, num_q_heads, head_dim)
    seq, _, valid = token_layout(query_start_loc, context_lens, num_seqs, num_tokens)
    j = jnp.arange(num_tokens, dtype=jnp.int32) - query_start_loc[seq]
    src = (first_block[seq] + j // block_q) * block_q + j % block_q
    out = jnp.take(out, jnp.clip(src, 0, num_blocks * block_q - 1), axis=0)
    return jnp.where(valid[:, None, None], out, jnp.zeros((), out.dtype))
