"""Small pieces shared by the paged-attention references and kernels.

Everything here is plain ``jnp`` so it traces the same way inside XLA code, a Triton kernel body and a
Mosaic TPU kernel body.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Logits of masked keys. -inf (not a large finite number) so that a fully masked row has an exact zero
# weight everywhere; the online softmax below guards the -inf - -inf case explicitly.
NEG_INF = float("-inf")

# 32-bit words the TPU kernels may scalar-prefetch into SMEM (page table, lengths, block schedule): half of v5e's
# 1 MiB SMEM, which also holds the compiler's own scalars. Measured with libtpu (tests/aot): a 131,072-word page table
# compiles, 262,144 words exceed SMEM. A bigger case falls back.
SMEM_BUDGET_WORDS = 1 << 17


class UnsupportedCase(NotImplementedError):
    """Raised at trace time by a kernel wrapper for shapes/dtypes it cannot handle.

    The dispatcher catches it and falls through to the next implementation. It must only be raised from
    static (shape/dtype/config) checks, never from data-dependent conditions.
    """


# Lanes a stored pool row is padded to, per backend. A TPU tiles an array's last two dims by (8, 128), and for a row
# that is not a whole number of 128 lanes (SmolLM2: 3 KV heads x 64) its default layout, the one that pads least,
# puts the pages axis minor instead: a layout no kernel reads, so every step relaid the pools out and back.
POOL_LANE_MULTIPLE = {"tpu": 128}


def pool_row_width(num_kv_heads: int, head_dim: int, lane_multiple: int = 1, kv_shards: int = 1) -> int:
    """Elements of one token's row in a stored pool: its KV heads side by side, padded to `lane_multiple` per shard
    (a pool split over `kv_shards` devices by KV heads holds each shard's heads in its own padded chunk)."""
    per_shard = cdiv(num_kv_heads, kv_shards) * head_dim
    return kv_shards * cdiv(per_shard, lane_multiple) * lane_multiple


def pool_shape(
    num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, lane_multiple: int = 1, kv_shards: int = 1
) -> tuple[int, int, int]:
    """The KV pool as the engine stores it: f[num_pages, page_size, W], a token's KV heads side by side in one row of
    W >= Hkv * D elements (`pool_row_width`; W == Hkv * D except on a TPU). Unpadded it is the same bytes as
    [.., Hkv, D] in row-major order, the kernels' signatures' form (`heads_view`, a free reshape on CPU and GPU).
    It is the TPU kernels' own form: one page a [page_size, W] block, no per-head tiling to undo."""
    return num_pages, page_size, pool_row_width(num_kv_heads, head_dim, lane_multiple, kv_shards)


def rows_view(pages: jax.Array) -> jax.Array:
    """f[P, page_size, Hkv, D] -> the same bytes as rows, f[P, page_size, Hkv * D]."""
    return pages.reshape(*pages.shape[:2], pages.shape[2] * pages.shape[3])


def heads_shape(pool, num_kv_heads: int, head_dim: int) -> jax.ShapeDtypeStruct:
    """The [.., Hkv, D] form of a stored pool f[P, page_size, W], as a shape: what the kernels' checks read."""
    return jax.ShapeDtypeStruct((*pool.shape[:2], num_kv_heads, head_dim), pool.dtype)


def rows_as_heads(
    k_rows, v_rows, num_kv_heads: int, head_dim: int
) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
    """The [.., Hkv, D] shapes of a kernel's stored K and V pools (`heads_shape`), which must be alike and hold
    Hkv x D elements a row (a TPU kernel reads the rows themselves)."""
    if v_rows.shape != k_rows.shape or k_rows.shape[2] < num_kv_heads * head_dim:
        raise UnsupportedCase(f"pool rows {k_rows.shape} / {v_rows.shape} do not hold {num_kv_heads} x {head_dim}")
    return heads_shape(k_rows, num_kv_heads, head_dim), heads_shape(v_rows, num_kv_heads, head_dim)


def heads_view(pool: jax.Array, num_kv_heads: int, head_dim: int) -> jax.Array:
    """A stored pool f[P, page_size, W] (`pool_shape`) as f[P, page_size, Hkv, D]: a reshape, after a slice when
    the rows are padded (a copy: only a kernel that reads padded rows, the TPU's, avoids it)."""
    width = num_kv_heads * head_dim
    if pool.shape[2] != width:
        pool = pool[:, :, :width]
    return pool.reshape(*pool.shape[:2], num_kv_heads, head_dim)


def check_pool_offsets(k_pages) -> None:
    """Element offsets into the KV pool are int32 in the kernels (Triton pointers, Mosaic DMA addresses)."""
    elements = 1
    for n in k_pages.shape:
        elements *= int(n)
    if elements > 2**31 - 1:
        raise UnsupportedCase(f"int32: the KV pool has {elements} elements, past int32 offsets")


def cdiv(a, b):
    """Ceiling division that works for Python ints and traced integer scalars/arrays."""
    return (a + b - 1) // b


def is_power_of_2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def apply_soft_cap(
    logits: jax.Array,  # f32[..., S]
    soft_cap: float | None,
) -> jax.Array:  # f32[..., S]
    # Gemma-2 style capping: smooth clamp of the logits into (-cap, cap).
    if soft_cap is None:
        return logits
    return soft_cap * jnp.tanh(logits / soft_cap)


def key_mask(
    q_pos: jax.Array,  # i32[..., 1] absolute position of each query row
    k_pos: jax.Array,  # i32[1, S] (or broadcastable) absolute position of each key
    kv_len: jax.Array,  # i32 scalar or broadcastable: keys at positions >= kv_len do not exist
    sliding_window: int,
) -> jax.Array:  # bool[..., S]
    """Causal (+ optional sliding window) mask; keys past the sequence end are always masked."""
    mask = (k_pos <= q_pos) & (k_pos < kv_len)
    if sliding_window > 0:
        mask = mask & (q_pos - k_pos < sliding_window)
    return mask


def online_softmax_step(
    logits: jax.Array,  # f32[..., S] already masked with -inf
    m_prev: jax.Array,  # f32[...] running max (may be -inf)
    l_prev: jax.Array,  # f32[...] running sum of exp
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """One flash-attention update over the last axis. Returns (p f32[..., S], correction f32[...], m_next f32[...],
    l_next f32[...]).

    The caller rescales its accumulator by ``correction`` and adds ``p @ v``. A row with no valid key so
    far keeps m = -inf; we substitute 0 for the subtraction so that exp(-inf - 0) = 0 instead of NaN.
    """
    m_next = jnp.maximum(m_prev, jnp.max(logits, axis=-1))
    m_safe = jnp.where(m_next == NEG_INF, 0.0, m_next)
    p = jnp.exp(logits - m_safe[..., None])
    correction = jnp.exp(m_prev - m_safe)
    l_next = correction * l_prev + jnp.sum(p, axis=-1)
    return p, correction, m_next, l_next


def safe_normalize(
    acc: jax.Array,  # f32[..., D] unnormalised sum_k p_k v_k
    denom: jax.Array,  # f32[...] sum_k p_k
) -> jax.Array:  # f32[..., D]
    # A row that saw no valid key (length 0, padding) has denom == 0 and acc == 0: return zeros, not NaN.
    return acc / jnp.where(denom == 0.0, 1.0, denom)[..., None]
