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

Layout: the engine stores each pool as rows, [num_pages, page_size, W] (``common.pool_shape``: a token's KV heads
side by side, W = Hkv * D padded to whole 128-lane rows on a TPU), and this kernel reads that form
(``paged_decode_attention_rows``; ``paged_decode_attention`` takes [.., Hkv, D] pools and reshapes them for free).
A block is one whole page [page_size, W]: its last two dims equal the array's, as Mosaic's tiling rule asks, and
they are the two a TPU tiles, so the pool is read where it lies. (Stored as [.., Hkv, D], or as unpadded rows of
3 x 64, the TPU's default layouts were ones no kernel reads, and each step copied every pool in and out.) GQA
without per-head slices: the wrapper spreads the queries block-diagonally, query head h of KV group g = h // G
holding its D values in lanes [g * D, (g + 1) * D) and zeros elsewhere (the row's padding included, where K's
padding lanes are zeroed in the kernel: 0 * NaN would be NaN), so one [Hq, W] x [page_size, W]^T matmul gives
every head's logits against its own KV head exactly. p @ V then fills all W lanes of each query row, and the
wrapper keeps the row's own group. That spends Hkv x the MXU flops of a per-head dot, which a memory-bound decode
step can afford, and needs no strided loads, masks by head or in-kernel transposes.

Verified here in interpret mode and compiled with libtpu's XLA:TPU + Mosaic at the served models' shapes (tests/aot);
not yet run on a TPU; see README.
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
    rows_as_heads,
    rows_view,
)

_SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16)
# KV tokens one grid step aims to cover (pages_per_step = this // page_size).
_TARGET_KV_TOKENS = 128
# VMEM the kernel asks Mosaic for (passed as vmem_limit_bytes): every TPU generation since v4 has >= 16 MiB per core.
VMEM_LIMIT_BYTES = 16 * 1024 * 1024


def default_pages_per_step(page_size: int, pages_per_seq: int) -> int:
    return max(1, min(pages_per_seq, _TARGET_KV_TOKENS // page_size))


def vmem_bytes(num_q_heads: int, head_dim: int, page_size: int, num_kv_heads: int, dtype, pages_per_step: int) -> int:
    """Upper estimate of the kernel's VMEM: double-buffered inputs/outputs, scratch and f32 temporaries."""
    size = jnp.dtype(dtype).itemsize
    sublanes = 8 * (4 // size)  # rows per tile: 8 for 32-bit, 16 for bf16 (two rows packed per sublane)
    rows = cdiv(num_q_heads, sublanes) * sublanes
    lanes = cdiv(num_kv_heads * head_dim, 128) * 128
    kv = 2 * 2 * pages_per_step * cdiv(page_size, sublanes) * sublanes * lanes * size  # K and V, two buffers each
    q_and_out = 2 * 2 * rows * lanes * size
    scratch = rows * (lanes + 2 * 128) * 4
    temps = rows * (4 * cdiv(page_size, 128) * 128 + 2 * lanes) * 4  # logits, p, masks of one page; p @ v
    return kv + q_and_out + scratch + temps


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
    # The head dims the kernel is compile-checked at (tests/aot): whole 128-lane vregs, or 64.
    if head_dim % 128 and head_dim != 64:
        raise UnsupportedCase(f"head_dim={head_dim} not a multiple of 128 (or 64)")
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
    q_ref,  # f[Hq, Hkv * D] block-diagonal queries (see module docstring)
    *refs,  # pages_per_step K pages f[page_size, Hkv * D], as many V pages, o f[Hq, Hkv * D], then the scratch:
    # m VMEM f32[Hq, 1] running max, l VMEM f32[Hq, 1] running sum, acc VMEM f32[Hq, Hkv * D] running numerator
    scale: float,
    soft_cap: float | None,
    sliding_window: int,
    page_size: int,
    pages_per_step: int,
    kv_width: int,
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
                _page_step, page, length, q_ref, k_refs[j], v_refs[j], m_ref, l_ref, acc_ref, scale=scale,
                soft_cap=soft_cap, sliding_window=sliding_window, page_size=page_size, kv_width=kv_width,
            )
        )  # fmt: skip

    @pl.when(i == pl.num_programs(1) - 1)
    def _finish():
        denom = l_ref[...]
        o_ref[...] = (acc_ref[...] / jnp.where(denom == 0.0, 1.0, denom)).astype(o_ref.dtype)


def _page_step(
    i, length, q_ref, k_ref, v_ref, m_ref, l_ref, acc_ref, *, scale: float, soft_cap: float | None,
    sliding_window: int, page_size: int, kv_width: int,
):  # fmt: skip
    """Online-softmax update of the running (m, l, acc) with page ``i`` of the row (all heads at once)."""
    q, k, v = q_ref[...], k_ref[...], v_ref[...]
    if kv_width < k.shape[-1]:
        # The row's padding lanes meet the queries' zeros, and 0 * NaN = NaN: zero them whatever they hold. (V's
        # padding lands only in output lanes the wrapper drops.)
        lane = lax.broadcasted_iota(jnp.int32, k.shape, 1)
        k = jnp.where(lane < kv_width, k, jnp.zeros((), k.dtype))
    logits = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    logits = apply_soft_cap(logits * scale, soft_cap)  # f32[Hq, page_size]
    # The key positions at the full [Hq, page_size] shape: int compares, no i1 broadcasts for Mosaic.
    k_pos = i * page_size + lax.broadcasted_iota(jnp.int32, logits.shape, 1)
    logits = jnp.where(key_mask(length - 1, k_pos, length, sliding_window), logits, NEG_INF)

    m_prev, l_prev = m_ref[...], l_ref[...]
    m_next = jnp.maximum(m_prev, jnp.max(logits, axis=-1, keepdims=True))
    m_safe = jnp.where(m_next == NEG_INF, 0.0, m_next)
    p = jnp.exp(logits - m_safe)
    corr = jnp.exp(m_prev - m_safe)
    l_ref[...] = corr * l_prev + jnp.sum(p, axis=-1, keepdims=True)
    m_ref[...] = m_next
    # Tail slots of the last page may hold NaN: p == 0 there, but 0 * NaN = NaN, so zero V itself.
    row = lax.broadcasted_iota(jnp.int32, (v.shape[0], 1), 0)
    v = jnp.where(row < length - i * page_size, v, jnp.zeros((), v.dtype))
    pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    acc_ref[...] = acc_ref[...] * corr + pv


def paged_decode_attention(
    q: jax.Array,  # f[B, Hq, D]
    k_pages: jax.Array,  # f[num_pages, page_size, Hkv, D]
    v_pages: jax.Array,  # f[num_pages, page_size, Hkv, D]
    page_table: jax.Array,  # i32[B, pages_per_seq]
    lengths: jax.Array,  # i32[B]
    **kw,
) -> jax.Array:  # f[B, Hq, D]
    """The kernel on [.., Hkv, D] pools (a free reshape to rows); see `paged_decode_attention_rows`."""
    return paged_decode_attention_rows(
        q, rows_view(k_pages), rows_view(v_pages), page_table, lengths, num_kv_heads=k_pages.shape[2], **kw
    )


@functools.partial(
    jax.jit, static_argnames=("num_kv_heads", "scale", "sliding_window", "soft_cap", "pages_per_step", "interpret")
)
def paged_decode_attention_rows(
    q: jax.Array,  # f[B, Hq, D]
    k_rows: jax.Array,  # f[num_pages, page_size, W]: a pool as stored (common.pool_shape), W >= Hkv * D
    v_rows: jax.Array,  # f[num_pages, page_size, W]
    page_table: jax.Array,  # i32[B, pages_per_seq]
    lengths: jax.Array,  # i32[B]
    *,
    num_kv_heads: int,
    scale: float,
    sliding_window: int = 0,
    soft_cap: float | None = None,
    pages_per_step: int | None = None,
    interpret: bool | pltpu.InterpretParams = False,
) -> jax.Array:  # f[B, Hq, D]
    """``pages_per_step``: KV pages per grid step (default: about 128 tokens). ``interpret``: True for the
    generic Pallas interpreter, or ``pltpu.InterpretParams()`` for the TPU-faithful one (simulated
    DMAs/semaphores, stricter bounds)."""
    batch, num_q_heads, head_dim = q.shape
    num_pages, page_size, lanes = k_rows.shape
    check_supported(q, *rows_as_heads(k_rows, v_rows, num_kv_heads, head_dim), page_table, pages_per_step)
    group = num_q_heads // num_kv_heads
    pages_per_seq = page_table.shape[1]
    pps = pages_per_step or default_pages_per_step(page_size, pages_per_seq)

    # Block-diagonal queries: head h's values in its KV group's lanes, zeros in the others' and in the row's padding
    # (module docstring).
    own = (jnp.arange(num_q_heads)[:, None] // group == jnp.arange(num_kv_heads)[None, :]).astype(q.dtype)
    q_wide = (q[:, :, None, :] * own[None, :, :, None]).reshape(batch, num_q_heads, num_kv_heads * head_dim)
    q_wide = jnp.pad(q_wide, ((0, 0), (0, 0), (0, lanes - num_kv_heads * head_dim)))

    kv_specs = [
        pl.BlockSpec(
            (None, page_size, lanes),
            functools.partial(
                _kv_index_map, pages_per_seq=pages_per_seq, page_size=page_size, window=sliding_window, step=pps, j=j
            ),
        )
        for j in range(pps)
    ]
    q_spec = pl.BlockSpec((None, num_q_heads, lanes), lambda b, i, *_: (b, 0, 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(batch, cdiv(pages_per_seq, pps)),
        in_specs=[q_spec, *kv_specs, *kv_specs],
        out_specs=q_spec,
        scratch_shapes=[
            pltpu.VMEM((num_q_heads, 1), jnp.float32),
            pltpu.VMEM((num_q_heads, 1), jnp.float32),
            pltpu.VMEM((num_q_heads, lanes), jnp.float32),
        ],
    )
    kernel = functools.partial(
        _decode_kernel,
        scale=scale,
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        page_size=page_size,
        pages_per_step=pps,
        kv_width=num_kv_heads * head_dim,
    )
    out = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((batch, num_q_heads, lanes), q.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary"), vmem_limit_bytes=VMEM_LIMIT_BYTES
        ),
        interpret=interpret,
        name="paged_decode_attention_tpu",
    )(
        # 1-D in SMEM: 2-D SMEM arrays are padded to (8, 128) tiles.
        page_table.astype(jnp.int32).reshape(-1),
        lengths.astype(jnp.int32),
        q_wide,
        *[k_rows] * pps,
        *[v_rows] * pps,
    )
    # Each query head keeps the lanes of its own KV group.
    out = out[:, :, : num_kv_heads * head_dim].reshape(batch, num_q_heads, num_kv_heads, head_dim)
    groups = (jnp.arange(num_q_heads) // group)[None, :, None, None]
    return jnp.take_along_axis(out, groups, axis=2)[:, :, 0]
