"""Paged decode attention for TPU: Pallas/Mosaic with scalar-prefetched page table and lengths.

Grid (batch, KV step); a step covers ``pages_per_step`` pages. The page table and lengths live in SMEM
(PrefetchScalarGridSpec), so the K/V BlockSpec index maps can look up which physical pages the next grid
step needs and the Pallas pipeline DMAs them into VMEM while the current step is processed: the pool is
passed ``pages_per_step`` times, input j holding page ``step * pages_per_step + j``. Pages past a row's
last needed page (or before its sliding window) clamp their index map to a needed page -- the pipeline
sees an unchanged block index and skips the copy -- and skip the compute with ``pl.when``, so a row's
DMA and compute are bounded by its live length; the steps past it cost only the grid-step overhead,
``pages_per_step`` times fewer of them than with one page per step. The running (max, sum, acc) live in
VMEM scratch across the "arbitrary" step axis.

Static budgets (``check_supported``): the scalar-prefetched page table must fit SMEM, the buffers the
VMEM limit passed to Mosaic, and every element offset into the pool int32; a case over one is an
``UnsupportedCase`` and the dispatcher falls back (with a warning) instead of failing to compile.

Layout: the pool [num_pages, page_size, Hkv, D] is viewed (a free reshape) as [num_pages, page_size *
Hkv, D], so one block is a whole page with every KV head and its last two dims equal the array's (a
Mosaic tiling rule that a per-head block [page_size, squeezed Hkv, D] breaks). Row c of the block is
token c // Hkv of KV head c % Hkv. All Hq query heads are multiplied against all page_size * Hkv rows in
one matmul and the cross-head products are masked to -inf, so p is zero off the matching head and
``p @ v`` is exactly the per-head result. That spends Hkv x the MXU flops of a per-head dot, which a
memory-bound decode step can afford, and needs no strided sublane loads or in-kernel transposes. The
column -> (token, head) and row -> head maps are tiny precomputed inputs (no vector integer division).

Only verified here in interpret mode and by lowering to Mosaic MLIR (no TPU available); see README.
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
    key_mask,
)

_SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16)
# Cap on the all-heads logits tile (Hq x page_size * Hkv f32) that the masked-GQA trick materialises.
_MAX_LOGITS_ELEMS = 1 << 17
# KV tokens one grid step aims to cover (pages_per_step = this // page_size).
_TARGET_KV_TOKENS = 128
# VMEM the kernel asks Mosaic for (passed as vmem_limit_bytes): every TPU generation since v4 has >= 16 MiB per core.
VMEM_LIMIT_BYTES = 16 * 1024 * 1024


def default_pages_per_step(page_size: int, pages_per_seq: int) -> int:
    return max(1, min(pages_per_seq, _TARGET_KV_TOKENS // page_size))


def vmem_bytes(num_q_heads: int, head_dim: int, page_size: int, num_kv_heads: int, dtype, pages_per_step: int) -> int:
    """Upper estimate of the kernel's VMEM: double-buffered inputs/outputs, scratch and f32 temporaries."""
    size = jnp.dtype(dtype).itemsize
    rows = cdiv(num_q_heads, 8) * 8  # sublane padding
    lanes = cdiv(head_dim, 128) * 128
    page_rows = page_size * num_kv_heads
    kv = 2 * 2 * pages_per_step * cdiv(page_rows, 16) * 16 * lanes * size  # K and V, two buffers each
    q_and_out = 2 * 2 * rows * lanes * size
    maps = 2 * (rows * 128 + 2 * 8 * cdiv(page_rows, 128) * 128) * 4
    scratch = rows * (lanes + 2 * 128) * 4
    temps = 4 * rows * cdiv(page_rows, 128) * 128 * 4  # logits, p, masks of one page
    return kv + q_and_out + maps + scratch + temps


def check_supported(
    q: jax.Array,  # f[B, Hq, D]
    k_pages: jax.Array,  # f[num_pages, page_size, Hkv, D]
    v_pages: jax.Array,  # f[num_pages, page_size, Hkv, D]
    page_table: jax.Array | None = None,  # i32[B, pages_per_seq]; None: the SMEM check is skipped
    pages_per_step: int | None = None,
) -> None:
    batch, num_q_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, _ = k_pages.shape
    if k_pages.shape != v_pages.shape:
        raise UnsupportedCase("k_pages and v_pages shapes differ")
    if num_q_heads % num_kv_heads:
        raise UnsupportedCase(f"num_q_heads={num_q_heads} not a multiple of num_kv_heads={num_kv_heads}")
    # Lane-dense tiles: head_dim fills whole 128-lane vregs (64 is padded but still lowers).
    if head_dim % 128 and head_dim != 64:
        raise UnsupportedCase(f"head_dim={head_dim} not a multiple of 128 (or 64)")
    if (page_size * num_kv_heads) % 8:
        raise UnsupportedCase(f"page_size*num_kv_heads={page_size * num_kv_heads} not a multiple of 8")
    if num_q_heads * page_size * num_kv_heads > _MAX_LOGITS_ELEMS:
        raise UnsupportedCase("all-heads logits tile too large for VMEM")
    if not (q.dtype == k_pages.dtype == v_pages.dtype) or q.dtype not in _SUPPORTED_DTYPES:
        raise UnsupportedCase(f"dtypes q={q.dtype} k={k_pages.dtype} v={v_pages.dtype}")
    check_pool_offsets(k_pages)
    pps = pages_per_step or default_pages_per_step(page_size, _TARGET_KV_TOKENS)
    if page_table is not None:
        pps = pages_per_step or default_pages_per_step(page_size, page_table.shape[1])
        words = page_table.shape[0] * page_table.shape[1] + batch
        if words > SMEM_BUDGET_WORDS:
            raise UnsupportedCase(f"SMEM: the page table and lengths take {words} words > {SMEM_BUDGET_WORDS}")
    need = vmem_bytes(num_q_heads, head_dim, page_size, num_kv_heads, q.dtype, pps)
    if need > VMEM_LIMIT_BYTES:
        raise UnsupportedCase(f"VMEM: {need} bytes of buffers > the {VMEM_LIMIT_BYTES}-byte limit")


def _needed_pages(
    length: jax.Array,  # i32[] row length
    page_size: int,
    sliding_window: int,
) -> tuple[jax.Array, jax.Array]:  # (first, last) needed page index, inclusive; last < first if none
    last = cdiv(length, page_size) - 1
    if sliding_window <= 0:
        return jnp.int32(0), last
    return jnp.maximum(length - sliding_window, 0) // page_size, last


def _kv_index_map(
    b, i, page_table_ref, lengths_ref, *, pages_per_seq: int, page_size: int, window: int, step: int, j: int
):
    first, last = _needed_pages(lengths_ref[b], page_size, window)
    # Page j of grid step i, clamped into the needed range: repeated block indices make the pipeline skip the
    # DMA, and garbage page-table slots past the end are never dereferenced.
    page = i * step + j
    i_eff = jnp.clip(jnp.maximum(jnp.minimum(page, last), first), 0, pages_per_seq - 1)
    return page_table_ref[b * pages_per_seq + i_eff], 0, 0


def _decode_kernel(
    page_table_ref,  # SMEM i32[B * pages_per_seq]
    lengths_ref,  # SMEM i32[B]
    q_ref,  # f[Hq, D]
    row_head_ref,  # i32[Hq, 1] kv head of each query head
    col_head_ref,  # i32[1, page_size * Hkv] kv head of each page row
    col_tok_ref,  # i32[1, page_size * Hkv] token offset (in the page) of each page row
    *refs,  # pages_per_step K pages f[page_size * Hkv, D], as many V pages, o f[Hq, D], then the scratch:
    # m VMEM f32[Hq, 1] running max, l VMEM f32[Hq, 1] running sum, acc VMEM f32[Hq, D] running numerator
    scale: float,
    soft_cap: float | None,
    sliding_window: int,
    page_size: int,
    pages_per_step: int,
):
    del page_table_ref  # only used by the index maps
    k_refs, v_refs = refs[:pages_per_step], refs[pages_per_step : 2 * pages_per_step]
    o_ref, m_ref, l_ref, acc_ref = refs[2 * pages_per_step :]
    b, i = pl.program_id(0), pl.program_id(1)
    length = lengths_ref[b]
    first, last = _needed_pages(length, page_size, sliding_window)

    @pl.when(i == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, NEG_INF, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    for j in range(pages_per_step):
        page = i * pages_per_step + j
        pl.when((page >= first) & (page <= last))(
            functools.partial(
                _page_step, page, length, q_ref, row_head_ref, col_head_ref, col_tok_ref, k_refs[j], v_refs[j],
                m_ref, l_ref, acc_ref, scale=scale, soft_cap=soft_cap, sliding_window=sliding_window,
                page_size=page_size,
            )
        )  # fmt: skip

    @pl.when(i == pl.num_programs(1) - 1)
    def _finish():
        denom = l_ref[...]
        o_ref[...] = (acc_ref[...] / jnp.where(denom == 0.0, 1.0, denom)).astype(o_ref.dtype)


def _page_step(
    i, length, q_ref, row_head_ref, col_head_ref, col_tok_ref, k_ref, v_ref, m_ref, l_ref, acc_ref,
    *, scale: float, soft_cap: float | None, sliding_window: int, page_size: int,
):  # fmt: skip
    """Online-softmax update of the running (m, l, acc) with page ``i`` of the row (all heads at once)."""
    q, k, v = q_ref[...], k_ref[...], v_ref[...]
    logits = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    logits = apply_soft_cap(logits * scale, soft_cap)  # f32[Hq, page_size * Hkv]
    # Build every mask operand at the full [Hq, C] shape: int compares, no i1 broadcasts for Mosaic.
    full = lambda x: jnp.broadcast_to(x, logits.shape)
    k_pos = full(i * page_size + col_tok_ref[...])
    same_head = full(col_head_ref[...]) == full(row_head_ref[...])
    mask = key_mask(length - 1, k_pos, length, sliding_window) & same_head
    logits = jnp.where(mask, logits, NEG_INF)

    m_prev, l_prev = m_ref[...], l_ref[...]
    m_next = jnp.maximum(m_prev, jnp.max(logits, axis=-1, keepdims=True))
    m_safe = jnp.where(m_next == NEG_INF, 0.0, m_next)
    p = jnp.exp(logits - m_safe)
    corr = jnp.exp(m_prev - m_safe)
    l_ref[...] = corr * l_prev + jnp.sum(p, axis=-1, keepdims=True)
    m_ref[...] = m_next
    # Tail slots of the last page may hold NaN: p == 0 there, but 0 * NaN = NaN, so zero V itself.
    # Row c is token c // Hkv, and c // Hkv < n  <=>  c < n * Hkv: no vector division needed.
    num_kv_heads = v.shape[0] // page_size
    row = lax.broadcasted_iota(jnp.int32, (v.shape[0], 1), 0)
    v = jnp.where(row < (length - i * page_size) * num_kv_heads, v, jnp.zeros((), v.dtype))
    pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    acc_ref[...] = acc_ref[...] * corr + pv


@functools.partial(jax.jit, static_argnames=("scale", "sliding_window", "soft_cap", "pages_per_step", "interpret"))
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
    pages_per_step: int | None = None,
    interpret: bool | pltpu.InterpretParams = False,
) -> jax.Array:  # f[B, Hq, D]
    """``pages_per_step``: KV pages per grid step (default: about 128 tokens). ``interpret``: True for the
    generic Pallas interpreter, or ``pltpu.InterpretParams()`` for the TPU-faithful one (simulated
    DMAs/semaphores, stricter bounds)."""
    check_supported(q, k_pages, v_pages, page_table, pages_per_step)
    batch, num_q_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, _ = k_pages.shape
    group = num_q_heads // num_kv_heads
    pages_per_seq = page_table.shape[1]
    page_rows = page_size * num_kv_heads
    pps = pages_per_step or default_pages_per_step(page_size, pages_per_seq)

    # Static GQA maps (see module docstring); constant block index, so DMA'd once.
    row_head = (jnp.arange(num_q_heads, dtype=jnp.int32) // group).reshape(num_q_heads, 1)
    col = jnp.arange(page_rows, dtype=jnp.int32).reshape(1, page_rows)
    col_head, col_tok = col % num_kv_heads, col // num_kv_heads

    kv_specs = [
        pl.BlockSpec(
            (None, page_rows, head_dim),
            functools.partial(
                _kv_index_map, pages_per_seq=pages_per_seq, page_size=page_size, window=sliding_window, step=pps, j=j
            ),
        )
        for j in range(pps)
    ]
    q_spec = pl.BlockSpec((None, num_q_heads, head_dim), lambda b, i, *_: (b, 0, 0))
    const = lambda shape: pl.BlockSpec(shape, lambda b, i, *_: (0, 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(batch, cdiv(pages_per_seq, pps)),
        in_specs=[q_spec, const((num_q_heads, 1)), const((1, page_rows)), const((1, page_rows)), *kv_specs, *kv_specs],
        out_specs=q_spec,
        scratch_shapes=[
            pltpu.VMEM((num_q_heads, 1), jnp.float32),
            pltpu.VMEM((num_q_heads, 1), jnp.float32),
            pltpu.VMEM((num_q_heads, head_dim), jnp.float32),
        ],
    )
    kernel = functools.partial(
        _decode_kernel,
        scale=scale,
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        page_size=page_size,
        pages_per_step=pps,
    )
    k_view = k_pages.reshape(num_pages, page_rows, head_dim)  # free row-major reshape: a page is one block
    v_view = v_pages.reshape(num_pages, page_rows, head_dim)
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((batch, num_q_heads, head_dim), q.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary"), vmem_limit_bytes=VMEM_LIMIT_BYTES
        ),
        interpret=interpret,
        name="paged_decode_attention_tpu",
    )(
        # 1-D in SMEM: 2-D SMEM arrays are padded to (8, 128) tiles.
        page_table.astype(jnp.int32).reshape(-1),
        lengths.astype(jnp.int32),
        q,
        row_head,
        col_head,
        col_tok,
        *[k_view] * pps,
        *[v_view] * pps,
    )
