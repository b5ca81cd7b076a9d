"""The jnp references against an independent float64 numpy oracle (per-token dense masked softmax)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from paged_attention_cases import (
    REFERENCE_TOL,
    make_decode_case,
    make_ragged_case,
    naive_decode,
    naive_ragged,
)

from kernels_pallas import reference

# (head_dim, num_q_heads, num_kv_heads, page_size, sliding_window, soft_cap, dtype)
DECODE_CASES = [
    (64, 2, 2, 8, 0, None, jnp.float32),
    (128, 3, 1, 16, 0, None, jnp.float32),
    (256, 8, 2, 8, 5, None, jnp.float32),
    (64, 16, 2, 16, 0, 20.0, jnp.float32),
    (128, 12, 4, 8, 9, 5.0, jnp.bfloat16),
    (256, 4, 4, 16, 0, None, jnp.bfloat16),
]


@pytest.mark.parametrize("head_dim,hq,hkv,page_size,window,soft_cap,dtype", DECODE_CASES)
def test_decode_reference_matches_naive(head_dim, hq, hkv, page_size, window, soft_cap, dtype):
    # Lengths: empty row, a single token, a page multiple, and ragged non-multiples.
    lengths = [0, 1, 2 * page_size, 2 * page_size + 3, page_size - 1]
    case = make_decode_case(
        0, lengths, num_q_heads=hq, num_kv_heads=hkv, head_dim=head_dim, page_size=page_size, dtype=dtype
    )
    scale = head_dim**-0.5
    fn = jax.jit(reference.paged_decode_attention, static_argnames=("scale", "sliding_window", "soft_cap"))
    out = fn(*case.args(), scale=scale, sliding_window=window, soft_cap=soft_cap)
    assert out.shape == case.q.shape and out.dtype == dtype
    expected = naive_decode(case, scale=scale, sliding_window=window, soft_cap=soft_cap)
    rtol, atol = REFERENCE_TOL[dtype]
    np.testing.assert_allclose(np.asarray(out.astype(jnp.float32)), expected, rtol=rtol, atol=atol)
    assert not np.any(np.asarray(out[0])), "length-0 row must be exactly zero"


# (head_dim, num_q_heads, num_kv_heads, page_size, sliding_window, soft_cap, dtype, kv_chunk_pages)
RAGGED_CASES = [
    (64, 2, 2, 8, 0, None, jnp.float32, None),
    (128, 3, 1, 16, 0, None, jnp.float32, 1),
    (64, 8, 1, 8, 6, None, jnp.float32, 2),
    (256, 4, 1, 8, 0, 10.0, jnp.float32, None),
    (128, 8, 2, 16, 11, 30.0, jnp.bfloat16, 1),
]

# (q_len, context_len): full prefill, chunked prefill continuation, decode token, ragged lengths.
SEQS = [(13, 13), (5, 21), (1, 9), (1, 1), (8, 16), (0, 4)]


@pytest.mark.parametrize("head_dim,hq,hkv,page_size,window,soft_cap,dtype,chunk", RAGGED_CASES)
def test_ragged_reference_matches_naive(head_dim, hq, hkv, page_size, window, soft_cap, dtype, chunk):
    case = make_ragged_case(
        1,
        SEQS,
        max_seqs=len(SEQS) + 2,
        pad_tokens=3,
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=head_dim,
        page_size=page_size,
        dtype=dtype,
    )
    scale = head_dim**-0.5
    fn = jax.jit(
        reference.ragged_paged_attention,
        static_argnames=("scale", "sliding_window", "soft_cap", "kv_chunk_pages"),
    )
    out = fn(*case.args(), scale=scale, sliding_window=window, soft_cap=soft_cap, kv_chunk_pages=chunk)
    assert out.shape == case.q.shape and out.dtype == dtype
    expected = naive_ragged(case, scale=scale, sliding_window=window, soft_cap=soft_cap)
    rtol, atol = REFERENCE_TOL[dtype]
    np.testing.assert_allclose(np.asarray(out.astype(jnp.float32)), expected, rtol=rtol, atol=atol)
    assert not np.any(np.asarray(out[-3:])), "padding tokens must be exactly zero"


def test_ragged_reference_with_no_live_sequences_is_zero():
    case = make_ragged_case(
        2, [(3, 5)], max_seqs=2, pad_tokens=2, num_q_heads=2, num_kv_heads=1, head_dim=64, page_size=8
    )
    args = list(case.args())
    args[-1] = jnp.int32(0)
    out = reference.ragged_paged_attention(*args, scale=0.125)
    assert not np.any(np.asarray(out))


def test_decode_is_ragged_with_one_token_per_sequence():
    """The two references agree where their contracts overlap."""
    lengths = [1, 7, 17]
    case = make_decode_case(3, lengths, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=8)
    q, k, v, pt, lens = case.args()
    dec = reference.paged_decode_attention(q, k, v, pt, lens, scale=0.125, sliding_window=4)
    qsl = jnp.arange(len(lengths) + 1, dtype=jnp.int32)
    rag = reference.ragged_paged_attention(
        q, k, v, pt, lens, qsl, jnp.int32(len(lengths)), scale=0.125, sliding_window=4
    )
    np.testing.assert_allclose(np.asarray(dec), np.asarray(rag), rtol=1e-6, atol=1e-6)
