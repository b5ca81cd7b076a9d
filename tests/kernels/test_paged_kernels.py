"""Every Pallas kernel, run in interpret mode on CPU, against its jnp reference.

Interpret mode is slow (each grid step is an XLA while-loop iteration), so shapes are tiny and the
parameter lists are a representative subset of head_dim x GQA ratio x page size x window x soft cap x
dtype rather than the full product. Pools hold NaN in every slot a row does not own (see
paged_attention_cases), so a kernel that lets an unused page or page-table entry reach its output fails.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from paged_attention_cases import assert_close, make_decode_case, make_ragged_case

from kernels_pallas import decode_gpu, decode_tpu, ragged_gpu, reference

# (head_dim, num_q_heads, num_kv_heads, page_size, sliding_window, soft_cap, dtype)
DECODE_CASES = [
    pytest.param(64, 2, 2, 8, 0, None, jnp.float32, id="d64-g1-ps8"),
    pytest.param(128, 3, 1, 16, 7, None, jnp.float32, id="d128-g3-ps16-win"),
    pytest.param(256, 4, 1, 8, 0, 5.0, jnp.bfloat16, id="d256-g4-ps8-cap-bf16"),
    pytest.param(64, 8, 1, 16, 20, 30.0, jnp.bfloat16, id="d64-g8-ps16-win-cap-bf16"),
    pytest.param(128, 8, 2, 8, 0, None, jnp.bfloat16, id="d128-g4-ps8-bf16"),
]


def _decode_lengths(page_size: int) -> list[int]:
    # Empty row, one token, a page multiple, and a ragged non-multiple spanning several pages.
    return [0, 1, 2 * page_size, 3 * page_size + 5]


def _decode_case(head_dim, hq, hkv, page_size, dtype, seed=0):
    return make_decode_case(
        seed,
        _decode_lengths(page_size),
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=head_dim,
        page_size=page_size,
        dtype=dtype,
    )


@pytest.mark.parametrize("head_dim,hq,hkv,page_size,window,soft_cap,dtype", DECODE_CASES)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_gpu_kernel_matches_reference(head_dim, hq, hkv, page_size, window, soft_cap, dtype, num_splits):
    case = _decode_case(head_dim, hq, hkv, page_size, dtype)
    kw = dict(scale=head_dim**-0.5, sliding_window=window, soft_cap=soft_cap)
    expected = reference.paged_decode_attention(*case.args(), **kw)
    # block_kv=16 keeps several KV blocks per row (the loop, page gather and split logic all run).
    out = decode_gpu.paged_decode_attention(*case.args(), **kw, block_kv=16, num_splits=num_splits, interpret=True)
    assert out.shape == expected.shape and out.dtype == dtype
    assert_close(out, np.asarray(expected.astype(jnp.float32)), dtype)
    assert not np.any(np.asarray(out[0])), "length-0 row must be exactly zero"


@pytest.mark.parametrize("head_dim,hq,hkv,page_size,window,soft_cap,dtype", DECODE_CASES)
@pytest.mark.parametrize("pages_per_step", [None, 2])
def test_decode_tpu_kernel_matches_reference(head_dim, hq, hkv, page_size, window, soft_cap, dtype, pages_per_step):
    # pages_per_step=2: several grid steps per row, each with pages past the row's length to skip.
    case = _decode_case(head_dim, hq, hkv, page_size, dtype)
    kw = dict(scale=head_dim**-0.5, sliding_window=window, soft_cap=soft_cap)
    expected = reference.paged_decode_attention(*case.args(), **kw)
    out = decode_tpu.paged_decode_attention(*case.args(), **kw, pages_per_step=pages_per_step, interpret=True)
    assert out.shape == expected.shape and out.dtype == dtype
    assert_close(out, np.asarray(expected.astype(jnp.float32)), dtype)
    assert not np.any(np.asarray(out[0])), "length-0 row must be exactly zero"


def test_decode_tpu_kernel_under_tpu_interpreter():
    # The TPU-specific interpreter simulates the scalar-prefetch pipeline's DMAs into VMEM.
    case = _decode_case(128, 8, 2, 8, jnp.bfloat16, seed=3)
    kw = dict(scale=128**-0.5, sliding_window=9, soft_cap=None)
    expected = reference.paged_decode_attention(*case.args(), **kw)
    out = decode_tpu.paged_decode_attention(*case.args(), **kw, interpret=pltpu.InterpretParams())
    assert_close(out, np.asarray(expected.astype(jnp.float32)), jnp.bfloat16)


# (head_dim, num_q_heads, num_kv_heads, page_size, sliding_window, soft_cap, dtype, block_q)
RAGGED_CASES = [
    pytest.param(64, 2, 2, 8, 0, None, jnp.float32, 16, id="d64-g1-ps8"),
    pytest.param(128, 3, 1, 16, 0, None, jnp.float32, 4, id="d128-g3-ps16"),
    pytest.param(64, 8, 1, 8, 6, 30.0, jnp.bfloat16, 2, id="d64-g8-ps8-win-cap-bf16"),
    pytest.param(256, 4, 1, 16, 9, None, jnp.bfloat16, 4, id="d256-g4-ps16-win-bf16"),
]

# (q_len, context_len): full prefill, chunked-prefill continuation, decode tokens, an idle live row.
RAGGED_SEQS = [(11, 11), (6, 21), (1, 9), (1, 1), (0, 5)]


@pytest.mark.parametrize("head_dim,hq,hkv,page_size,window,soft_cap,dtype,block_q", RAGGED_CASES)
def test_ragged_gpu_kernel_matches_reference(head_dim, hq, hkv, page_size, window, soft_cap, dtype, block_q):
    case = make_ragged_case(
        1,
        RAGGED_SEQS,
        max_seqs=len(RAGGED_SEQS) + 1,
        pad_tokens=2,
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=head_dim,
        page_size=page_size,
        dtype=dtype,
    )
    kw = dict(scale=head_dim**-0.5, sliding_window=window, soft_cap=soft_cap)
    expected = reference.ragged_paged_attention(*case.args(), **kw)
    out = ragged_gpu.ragged_paged_attention(*case.args(), **kw, block_q=block_q, block_kv=16, interpret=True)
    assert out.shape == expected.shape and out.dtype == dtype
    assert_close(out, np.asarray(expected.astype(jnp.float32)), dtype)
    assert not np.any(np.asarray(out[-2:])), "padding tokens must be exactly zero"


def test_kernels_are_deterministic():
    case = _decode_case(64, 4, 2, 8, jnp.bfloat16, seed=5)
    kw = dict(scale=0.125, sliding_window=0, soft_cap=None, interpret=True)
    a = decode_gpu.paged_decode_attention(*case.args(), **kw, block_kv=16, num_splits=2)
    b = decode_gpu.paged_decode_attention(*case.args(), **kw, block_kv=16, num_splits=2)
    np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))
    c = decode_tpu.paged_decode_attention(*case.args(), **kw)
    d = decode_tpu.paged_decode_attention(*case.args(), **kw)
    np.testing.assert_array_equal(np.asarray(c.astype(jnp.float32)), np.asarray(d.astype(jnp.float32)))

    rcase = make_ragged_case(
        6, [(5, 9), (1, 3)], max_seqs=3, pad_tokens=1, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=8
    )
    e = ragged_gpu.ragged_paged_attention(*rcase.args(), scale=0.125, block_kv=16, interpret=True)
    f = ragged_gpu.ragged_paged_attention(*rcase.args(), scale=0.125, block_kv=16, interpret=True)
    np.testing.assert_array_equal(np.asarray(e), np.asarray(f))


# --- on-device runs: skipped on this CPU machine, run on the GPU/TPU machines ------------------------

ON_GPU = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU to run compiled Triton kernels")
ON_TPU = pytest.mark.skipif(jax.default_backend() != "tpu", reason="needs a TPU to run compiled Mosaic kernels")
# Compiled kernels accumulate in a different order than XLA's reference: loosen f32 a little.
DEVICE_TOL = {jnp.float32: (1e-4, 1e-4), jnp.bfloat16: (2e-2, 2e-2)}


def _assert_device_close(out, expected, dtype):
    rtol, atol = DEVICE_TOL[dtype]
    np.testing.assert_allclose(
        np.asarray(out.astype(jnp.float32)), np.asarray(expected.astype(jnp.float32)), rtol=rtol, atol=atol
    )


@ON_GPU
@pytest.mark.parametrize("head_dim,hq,hkv,page_size,window,soft_cap,dtype", DECODE_CASES)
@pytest.mark.parametrize("num_splits", [1, 3, None])
def test_decode_gpu_kernel_on_device(head_dim, hq, hkv, page_size, window, soft_cap, dtype, num_splits):
    case = _decode_case(head_dim, hq, hkv, page_size, dtype)
    kw = dict(scale=head_dim**-0.5, sliding_window=window, soft_cap=soft_cap)
    out = decode_gpu.paged_decode_attention(*case.args(), **kw, block_kv=16, num_splits=num_splits)
    _assert_device_close(out, reference.paged_decode_attention(*case.args(), **kw), dtype)


@ON_GPU
@pytest.mark.parametrize("head_dim,hq,hkv,page_size,window,soft_cap,dtype,block_q", RAGGED_CASES)
def test_ragged_gpu_kernel_on_device(head_dim, hq, hkv, page_size, window, soft_cap, dtype, block_q):
    case = make_ragged_case(
        1,
        RAGGED_SEQS,
        max_seqs=len(RAGGED_SEQS) + 1,
        pad_tokens=2,
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=head_dim,
        page_size=page_size,
        dtype=dtype,
    )
    kw = dict(scale=head_dim**-0.5, sliding_window=window, soft_cap=soft_cap)
    out = ragged_gpu.ragged_paged_attention(*case.args(), **kw, block_q=block_q)
    _assert_device_close(out, reference.ragged_paged_attention(*case.args(), **kw), dtype)


@ON_TPU
@pytest.mark.parametrize("head_dim,hq,hkv,page_size,window,soft_cap,dtype", DECODE_CASES)
def test_decode_tpu_kernel_on_device(head_dim, hq, hkv, page_size, window, soft_cap, dtype):
    case = _decode_case(head_dim, hq, hkv, page_size, dtype)
    kw = dict(scale=head_dim**-0.5, sliding_window=window, soft_cap=soft_cap)
    out = decode_tpu.paged_decode_attention(*case.args(), **kw)
    _assert_device_close(out, reference.paged_decode_attention(*case.args(), **kw), dtype)
