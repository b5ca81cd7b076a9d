"""The CPU paged-attention path (kernels_pallas/cpu.py) against the float64 oracle and the jnp reference, over the
reference tests' shape grid: ragged lengths, chunked-prefill continuations (cached prefixes), decode tokens,
padding rows and tokens, sliding windows, soft-cap, f32 and bf16, and tables wider than the live pages."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from paged_attention_cases import (
    REFERENCE_TOL,
    assert_close,
    make_decode_case,
    make_ragged_case,
    naive_decode,
    naive_ragged,
)
from test_paged_reference import DECODE_CASES, RAGGED_CASES, SEQS

import kernels_pallas
from kernels_pallas import cpu, reference

STATIC = ("scale", "sliding_window", "soft_cap", "block_q")


def _oracle_close(out, expected, dtype):
    rtol, atol = REFERENCE_TOL[dtype]
    rtol, atol = (2 * rtol, 2 * atol) if dtype == jnp.bfloat16 else (rtol, atol)  # bf16 p in the P@V dot
    np.testing.assert_allclose(np.asarray(out.astype(jnp.float32)), expected, rtol=rtol, atol=atol)


# "cpu": what the dispatcher runs on CPU (the numba kernel for f32 pools, the jnp path for bf16); "cpu_jnp": the jnp
# path of kernels_pallas/cpu.py alone.
IMPLS = ["cpu", "cpu_jnp"]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("head_dim,hq,hkv,page_size,window,soft_cap,dtype", DECODE_CASES)
def test_cpu_decode_matches_oracle_and_reference(head_dim, hq, hkv, page_size, window, soft_cap, dtype, impl):
    lengths = [0, 1, 2 * page_size, 2 * page_size + 3, page_size - 1]
    case = make_decode_case(
        0, lengths, num_q_heads=hq, num_kv_heads=hkv, head_dim=head_dim, page_size=page_size, dtype=dtype
    )
    opts = dict(scale=head_dim**-0.5, sliding_window=window, soft_cap=soft_cap)
    out = jax.jit(lambda *a: kernels_pallas.paged_decode_attention(*a, **opts, impl=impl))(*case.args())
    assert out.shape == case.q.shape and out.dtype == dtype
    _oracle_close(out, naive_decode(case, **opts), dtype)
    ref = jax.jit(reference.paged_decode_attention, static_argnames=STATIC[:3])(*case.args(), **opts)
    assert_close(out, np.asarray(ref.astype(jnp.float32)), dtype)
    assert not np.any(np.asarray(out[0])), "length-0 row must be exactly zero"


# (rows per group, most groups, widest block-diagonal row): per-head dots wherever Hkv > 1, block-diagonal everywhere.
@pytest.mark.parametrize("group_rows,max_groups,max_row", [(3, 8, 0), (2, 2, 1 << 20)])
@pytest.mark.parametrize("head_dim,hq,hkv,page_size,window,soft_cap,dtype", DECODE_CASES)
def test_cpu_decode_row_groups_match_oracle(monkeypatch, head_dim, hq, hkv, page_size, window, soft_cap, dtype,
                                            group_rows, max_groups, max_row):  # fmt: skip
    """More rows than a group: rows sorted by length into groups (the last one padded), each group's KV loop over
    several chunks, as far as its own longest row (and from its first window chunk), and rows put back in order;
    both layouts of a group's dots."""
    monkeypatch.setattr(cpu, "DECODE_GROUP_ROWS", group_rows)
    monkeypatch.setattr(cpu, "DECODE_MAX_GROUPS", max_groups)
    monkeypatch.setattr(cpu, "DECODE_BLOCK_DIAG_MAX_ROW", max_row)
    monkeypatch.setattr(cpu, "DECODE_KV_CHUNK_TOKENS", 2 * page_size)
    ps = page_size
    lengths = [0, 1, 5 * ps + 3, 2 * ps, ps - 1, 7 * ps, 3, 0, 4 * ps + 1, 9]
    case = make_decode_case(
        3, lengths, num_q_heads=hq, num_kv_heads=hkv, head_dim=head_dim, page_size=page_size, dtype=dtype
    )
    opts = dict(scale=head_dim**-0.5, sliding_window=window, soft_cap=soft_cap)
    out = jax.jit(lambda *a: cpu.paged_decode_attention(*a, **opts))(*case.args())  # a fresh trace per patch
    assert out.shape == case.q.shape and out.dtype == dtype
    _oracle_close(out, naive_decode(case, **opts), dtype)
    assert not np.any(np.asarray(out[0])) and not np.any(np.asarray(out[7])), "length-0 rows must be exactly zero"


# The jnp path at block_q 4 (blocks that split a sequence, and sequences shorter than a block), the first case also
# at 1 (every token its own block) and 16 (one block per sequence here); the dispatcher's CPU choice at its own.
BLOCKED = [(*c[:-1], 4, "cpu_jnp") for c in RAGGED_CASES] + [(*RAGGED_CASES[0][:-1], b, "cpu_jnp") for b in (1, 16)]
DISPATCHED = [(*c[:-1], None, "cpu") for c in RAGGED_CASES]


@pytest.mark.parametrize("head_dim,hq,hkv,page_size,window,soft_cap,dtype,block_q,impl", BLOCKED + DISPATCHED)
def test_cpu_ragged_matches_oracle_and_reference(head_dim, hq, hkv, page_size, window, soft_cap, dtype, block_q,
                                                 impl):  # fmt: skip
    case = make_ragged_case(1, SEQS, max_seqs=len(SEQS) + 2, pad_tokens=3, num_q_heads=hq, num_kv_heads=hkv,
                            head_dim=head_dim, page_size=page_size, dtype=dtype)  # fmt: skip
    opts = dict(scale=head_dim**-0.5, sliding_window=window, soft_cap=soft_cap)
    if impl == "cpu":
        attend = lambda *a: kernels_pallas.ragged_paged_attention(*a, **opts, impl="cpu")
    else:
        attend = lambda *a: cpu.ragged_paged_attention(*a, **opts, block_q=block_q)
    out = jax.jit(attend)(*case.args())
    assert out.shape == case.q.shape and out.dtype == dtype
    _oracle_close(out, naive_ragged(case, **opts), dtype)
    ref = jax.jit(reference.ragged_paged_attention, static_argnames=STATIC[:3])(*case.args(), **opts)
    assert_close(out, np.asarray(ref.astype(jnp.float32)), dtype)
    assert not np.any(np.asarray(out[-3:])), "padding tokens must be exactly zero"


@pytest.mark.parametrize("head_dim,hq,hkv,page_size,window,soft_cap,dtype,chunk", RAGGED_CASES)
def test_cpu_ragged_block_groups_match_oracle(monkeypatch, head_dim, hq, hkv, page_size, window, soft_cap, dtype,
                                              chunk):  # fmt: skip
    """Small groups: blocks in several groups (the last padded, some all dead), each group's KV loop over one-page
    chunks up to its own last token (from its first window chunk); the decode tokens over one-page chunks too (the
    jnp decode path)."""
    monkeypatch.setattr(cpu, "RAGGED_GROUP_BLOCKS", 2)
    monkeypatch.setattr(cpu, "RAGGED_MAX_GROUPS", 3)
    monkeypatch.setattr(cpu, "KV_CHUNK_TOKENS", page_size)
    monkeypatch.setattr(cpu, "DECODE_KV_CHUNK_TOKENS", page_size)
    # (3, 2 * page_size + 1): a block whose last token is the first key of a chunk.
    seqs = (
        [(3, 2 * page_size + 1)]
        + SEQS
        + [(1, 3 * page_size + 2), (2 * page_size + 1, 3 * page_size), (1, 2 * page_size)]
    )
    case = make_ragged_case(5, seqs, max_seqs=len(seqs) + 1, pad_tokens=2, num_q_heads=hq, num_kv_heads=hkv,
                            head_dim=head_dim, page_size=page_size, dtype=dtype)  # fmt: skip
    opts = dict(scale=head_dim**-0.5, sliding_window=window, soft_cap=soft_cap)
    out = jax.jit(lambda *a: cpu.ragged_paged_attention(*a, **opts, block_q=4))(*case.args())  # a fresh trace
    assert out.shape == case.q.shape and out.dtype == dtype
    _oracle_close(out, naive_ragged(case, **opts), dtype)
    assert not np.any(np.asarray(out[-2:])), "padding tokens must be exactly zero"


def test_cpu_ragged_long_prefix_streams_kv_chunks(monkeypatch):
    """A budget small enough that the KV loop takes several chunks (the online-softmax merge across chunks)."""
    monkeypatch.setattr(cpu, "_GATHER_BUDGET", 1)
    seqs = [(7, 40), (1, 33), (20, 20)]
    case = make_ragged_case(4, seqs, max_seqs=4, pad_tokens=1, num_q_heads=4, num_kv_heads=2, head_dim=64,
                            page_size=4)  # fmt: skip
    opts = dict(scale=0.125, sliding_window=0, soft_cap=None)
    out = cpu.ragged_paged_attention(*case.args(), **opts, block_q=8)
    _oracle_close(out, naive_ragged(case, **opts), jnp.float32)


@pytest.mark.parametrize("impl", IMPLS)
def test_cpu_ragged_with_no_live_sequences_is_zero(impl):
    case = make_ragged_case(2, [(3, 5)], max_seqs=2, pad_tokens=2, num_q_heads=2, num_kv_heads=1, head_dim=64,
                            page_size=8)  # fmt: skip
    args = list(case.args())
    args[-1] = jnp.int32(0)
    attend = jax.jit(lambda *a: kernels_pallas.ragged_paged_attention(*a, scale=0.125, impl=impl))
    assert not np.any(np.asarray(attend(*args)))
