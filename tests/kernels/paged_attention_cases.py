"""Test-case builders and a naive dense oracle for the paged-attention tests.

Pools are filled with NaN everywhere except the slots a sequence actually owns (positions < its
length), and page-table entries past a row's last used page are garbage (-1, huge, or NaN pages), so
any implementation that lets an unused slot or entry reach its output fails the comparison.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

GARBAGE_PAGE_IDS = (-1, 1 << 30)

# (rtol, atol) of a Pallas kernel against the jnp reference. bf16: the kernels feed bf16 p into the
# P@V dot (tensor-core path) while the reference keeps p in f32, and outputs are rounded to bf16.
KERNEL_TOL = {jnp.float32: (1e-5, 1e-5), jnp.bfloat16: (2e-2, 2e-2)}
# (rtol, atol) of the reference against the float64 numpy oracle (inputs already rounded to the dtype).
REFERENCE_TOL = {jnp.float32: (1e-5, 1e-5), jnp.bfloat16: (1e-2, 1e-2)}


@dataclass
class PagedPool:
    k_pages: np.ndarray  # f32[num_pages, page_size, Hkv, D] NaN outside owned slots
    v_pages: np.ndarray  # f32[num_pages, page_size, Hkv, D]
    page_table: np.ndarray  # i32[rows, pages_per_seq] garbage past the used pages
    kv_lens: np.ndarray  # i32[rows]


def make_pool(
    rng: np.random.Generator,
    kv_lens: list[int],
    *,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    pages_per_seq: int,
    spare_pages: int = 3,
) -> PagedPool:
    rows = len(kv_lens)
    num_pages = rows * pages_per_seq + spare_pages
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    k_pages = np.full(shape, np.nan, np.float32)
    v_pages = np.full(shape, np.nan, np.float32)
    perm = rng.permutation(num_pages)  # pages scattered through the pool, never shared
    page_table = np.zeros((rows, pages_per_seq), np.int32)
    for r, n in enumerate(kv_lens):
        used = -(-n // page_size)
        assert used <= pages_per_seq
        page_table[r, :used] = perm[r * pages_per_seq : r * pages_per_seq + used]
        for j in range(used, pages_per_seq):
            # Unused entries: out-of-range ids, or pages that are all NaN.
            choice = (r + j) % 3
            page_table[r, j] = GARBAGE_PAGE_IDS[choice] if choice < 2 else perm[-1]
        for t in range(n):
            page, off = page_table[r, t // page_size], t % page_size
            k_pages[page, off] = rng.standard_normal((num_kv_heads, head_dim))
            v_pages[page, off] = rng.standard_normal((num_kv_heads, head_dim))
    return PagedPool(k_pages, v_pages, page_table, np.asarray(kv_lens, np.int32))


def dense_kv(pool: PagedPool, row: int) -> tuple[np.ndarray, np.ndarray]:
    """Contiguous f64 [n, Hkv, D] K and V of one row, read slot by slot."""
    n = int(pool.kv_lens[row])
    ps = pool.k_pages.shape[1]
    idx = [(pool.page_table[row, t // ps], t % ps) for t in range(n)]
    k = np.stack([pool.k_pages[p, o] for p, o in idx]) if n else np.zeros((0,) + pool.k_pages.shape[2:])
    v = np.stack([pool.v_pages[p, o] for p, o in idx]) if n else np.zeros((0,) + pool.v_pages.shape[2:])
    return k.astype(np.float64), v.astype(np.float64)


def naive_attention(
    q: np.ndarray,  # f64[Hq, D] one query token
    k: np.ndarray,  # f64[n, Hkv, D] contiguous keys of its sequence
    v: np.ndarray,  # f64[n, Hkv, D]
    q_pos: int,
    *,
    scale: float,
    sliding_window: int,
    soft_cap: float | None,
) -> np.ndarray:  # f64[Hq, D]
    num_q_heads, head_dim = q.shape
    group = num_q_heads // k.shape[1]
    out = np.zeros((num_q_heads, head_dim))
    pos = np.arange(k.shape[0])
    allowed = pos <= q_pos
    if sliding_window > 0:
        allowed &= q_pos - pos < sliding_window
    if not allowed.any():
        return out
    for h in range(num_q_heads):
        s = k[allowed, h // group] @ q[h] * scale
        if soft_cap is not None:
            s = soft_cap * np.tanh(s / soft_cap)
        w = np.exp(s - s.max())
        out[h] = (w / w.sum()) @ v[allowed, h // group]
    return out


def round_to(x: np.ndarray, dtype) -> np.ndarray:
    """Round through ``dtype`` so the oracle sees exactly the values the implementation sees."""
    return np.asarray(jnp.asarray(x, dtype).astype(jnp.float32))


@dataclass
class DecodeCase:
    q: np.ndarray  # f32[B, Hq, D] (already rounded to dtype)
    pool: PagedPool
    dtype: object

    def args(self):
        p = self.pool
        return (
            jnp.asarray(self.q, self.dtype),
            jnp.asarray(p.k_pages, self.dtype),
            jnp.asarray(p.v_pages, self.dtype),
            jnp.asarray(p.page_table),
            jnp.asarray(p.kv_lens),
        )


def make_decode_case(
    seed: int,
    lengths: list[int],
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype=jnp.float32,
) -> DecodeCase:
    rng = np.random.default_rng(seed)
    pages_per_seq = max(1, -(-max(lengths) // page_size)) + 1  # one spare column of garbage entries
    pool = make_pool(
        rng,
        lengths,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        pages_per_seq=pages_per_seq,
    )
    pool.k_pages, pool.v_pages = round_to(pool.k_pages, dtype), round_to(pool.v_pages, dtype)
    q = round_to(rng.standard_normal((len(lengths), num_q_heads, head_dim)), dtype)
    return DecodeCase(q, pool, dtype)


def naive_decode(case: DecodeCase, *, scale: float, sliding_window: int, soft_cap: float | None) -> np.ndarray:
    out = np.zeros(case.q.shape)
    for b, n in enumerate(case.pool.kv_lens):
        k, v = dense_kv(case.pool, b)
        out[b] = naive_attention(
            case.q[b].astype(np.float64),
            k,
            v,
            int(n) - 1,
            scale=scale,
            sliding_window=sliding_window,
            soft_cap=soft_cap,
        )
    return out


@dataclass
class RaggedCase:
    q: np.ndarray  # f32[T, Hq, D]
    pool: PagedPool  # rows = max_seqs; kv_lens = context_lens (garbage for padding rows)
    query_start_loc: np.ndarray  # i32[max_seqs + 1]
    num_seqs: int
    q_lens: list[int]
    dtype: object

    def args(self):
        p = self.pool
        return (
            jnp.asarray(self.q, self.dtype),
            jnp.asarray(p.k_pages, self.dtype),
            jnp.asarray(p.v_pages, self.dtype),
            jnp.asarray(p.page_table),
            jnp.asarray(p.kv_lens),
            jnp.asarray(self.query_start_loc),
            jnp.asarray(self.num_seqs, jnp.int32),
        )


def make_ragged_case(
    seed: int,
    seqs: list[tuple[int, int]],  # (q_len, context_len) per live sequence
    *,
    max_seqs: int,
    pad_tokens: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype=jnp.float32,
) -> RaggedCase:
    rng = np.random.default_rng(seed)
    q_lens = [ql for ql, _ in seqs]
    ctx = [c for _, c in seqs]
    assert all(0 <= ql <= c for ql, c in seqs)
    pages_per_seq = max(1, -(-max(ctx) // page_size)) + 1
    kv_lens = ctx + [0] * (max_seqs - len(seqs))
    pool = make_pool(
        rng,
        kv_lens,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        pages_per_seq=pages_per_seq,
    )
    pool.k_pages, pool.v_pages = round_to(pool.k_pages, dtype), round_to(pool.v_pages, dtype)
    # Padding rows: garbage lengths / start offsets must be ignored.
    pool.kv_lens[len(seqs) :] = 12345
    qsl = np.zeros(max_seqs + 1, np.int32)
    qsl[1 : len(seqs) + 1] = np.cumsum(q_lens)
    qsl[len(seqs) + 1 :] = 777
    num_tokens = sum(q_lens) + pad_tokens
    q = round_to(rng.standard_normal((num_tokens, num_q_heads, head_dim)), dtype)
    return RaggedCase(q, pool, qsl, len(seqs), q_lens, dtype)


def naive_ragged(case: RaggedCase, *, scale: float, sliding_window: int, soft_cap: float | None) -> np.ndarray:
    out = np.zeros(case.q.shape)
    for s, q_len in enumerate(case.q_lens):
        k, v = dense_kv(case.pool, s)
        ctx = int(case.pool.kv_lens[s])
        for j in range(q_len):
            t = int(case.query_start_loc[s]) + j
            out[t] = naive_attention(
                case.q[t].astype(np.float64),
                k,
                v,
                ctx - q_len + j,
                scale=scale,
                sliding_window=sliding_window,
                soft_cap=soft_cap,
            )
    return out


def assert_close(actual, expected, dtype) -> None:
    rtol, atol = KERNEL_TOL[dtype]
    np.testing.assert_allclose(np.asarray(jnp.asarray(actual, jnp.float32)), expected, rtol=rtol, atol=atol)
