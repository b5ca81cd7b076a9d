"""Dispatcher: implementation choice per impl/backend, fall-through on unsupported cases, and jit."""

from __future__ import annotations

import functools

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
)

import kernels_pallas as kp
from kernels_pallas import reference


def _shapes(head_dim: int, page_size: int = 16, dtype=jnp.float32):
    q = jax.ShapeDtypeStruct((2, 8, head_dim), dtype)
    kv = jax.ShapeDtypeStruct((6, page_size, 2, head_dim), dtype)
    return q, kv, kv


@pytest.mark.parametrize(
    "impl,decode,ragged",
    [
        ("pallas_gpu", "pallas_gpu", "pallas_gpu"),
        ("pallas_tpu", "pallas_tpu", "pallas_tpu"),
        ("interpret", "pallas_gpu_interpret", "pallas_gpu_interpret"),
        ("interpret_tpu", "pallas_tpu_interpret", "pallas_tpu_interpret"),
        *[("cpu", k, k) for k in ["cpu_numba" if jax.default_backend() == "cpu" else "cpu_jnp"]],  # numba: f32, CPU
        ("cpu_jnp", "cpu_jnp", "cpu_jnp"),
        ("reference", "reference", "reference"),
    ],
)
def test_supported_case_picks_the_kernel(impl, decode, ragged):
    assert kp.decode_implementation(*_shapes(128), impl=impl) == decode
    assert kp.ragged_implementation(*_shapes(128), impl=impl) == ragged


@pytest.mark.parametrize("impl", [i for i in kp.IMPLS if not i.startswith("cpu")])  # the CPU paths take any head_dim
def test_unsupported_head_dim_falls_through_to_reference(impl):
    # head_dim 80 is not a power of 2 (Triton tiles) nor lane aligned (Mosaic): every kernel declines.
    assert kp.decode_implementation(*_shapes(80), impl=impl) == "reference"
    assert kp.ragged_implementation(*_shapes(80), impl=impl) == "reference"


def test_interpret_falls_through_gpu_kernel_to_tpu_kernel():
    # page_size 24 is not a power of 2 (GPU kernel declines) but 24 * Hkv is a multiple of 8 (TPU accepts).
    assert kp.decode_implementation(*_shapes(128, page_size=24), impl="interpret") == "pallas_tpu_interpret"


def test_default_impl_follows_backend():
    expected = {"gpu": "pallas_gpu", "tpu": "pallas_tpu", "cpu": "cpu_numba"}.get(jax.default_backend(), "reference")
    assert kp.decode_implementation(*_shapes(128)) == expected


def test_unknown_impl_is_rejected():
    with pytest.raises(ValueError, match="impl="):
        kp.decode_implementation(*_shapes(128), impl="cuda")


def test_fallthrough_result_is_correct_under_jit():
    case = make_decode_case(0, [0, 1, 19], num_q_heads=4, num_kv_heads=2, head_dim=80, page_size=8)
    fn = jax.jit(functools.partial(kp.paged_decode_attention, scale=0.1, sliding_window=5, impl="interpret"))
    out = fn(*case.args())
    expected = naive_decode(case, scale=0.1, sliding_window=5, soft_cap=None)
    rtol, atol = REFERENCE_TOL[jnp.float32]
    np.testing.assert_allclose(np.asarray(out), expected, rtol=rtol, atol=atol)


def test_dispatched_kernels_under_jit_match_reference():
    case = make_decode_case(1, [3, 17], num_q_heads=4, num_kv_heads=1, head_dim=64, page_size=8)
    kw = dict(scale=0.125, soft_cap=20.0)
    out = jax.jit(functools.partial(kp.paged_decode_attention, impl="interpret", **kw))(*case.args())
    assert_close(out, np.asarray(reference.paged_decode_attention(*case.args(), **kw)), jnp.float32)

    rcase = make_ragged_case(
        2, [(4, 10), (1, 5)], max_seqs=3, pad_tokens=1, num_q_heads=4, num_kv_heads=1, head_dim=64, page_size=8
    )
    out = jax.jit(functools.partial(kp.ragged_paged_attention, impl="interpret", **kw))(*rcase.args())
    assert_close(out, np.asarray(reference.ragged_paged_attention(*rcase.args(), **kw)), jnp.float32)


def test_config_style_options_are_normalised():
    # Model configs may carry None/0 for "off" and numpy scalars; the dispatcher accepts them.
    case = make_decode_case(4, [5, 12], num_q_heads=2, num_kv_heads=1, head_dim=64, page_size=8)
    out = kp.paged_decode_attention(
        *case.args(), scale=np.float32(0.125), sliding_window=None, soft_cap=0.0, impl="interpret"
    )
    expected = reference.paged_decode_attention(*case.args(), scale=0.125)
    assert_close(out, np.asarray(expected), jnp.float32)


@pytest.mark.parametrize("which", ["gpu", "tpu"])
def test_accelerator_block_tables_lower_without_a_loop(which):
    """The ragged kernels' sequence-aligned block tables are built in XLA before the kernel. A loop there (jnp's
    default binary-search searchsorted) ran as a host-driven while outside the command buffers on an H200, in every
    mixed step; the tables are one compare-and-sum instead. Checked on the lowered program, and against a loop."""
    from kernels_pallas import ragged_gpu, ragged_tpu

    max_seqs, tokens, bq = 8, 64, 16
    if which == "gpu":
        fn = functools.partial(ragged_gpu.block_metadata, num_tokens=tokens, block_q=bq)
        args = (jnp.zeros(max_seqs + 1, jnp.int32), jnp.zeros(max_seqs, jnp.int32), jnp.int32(1))
    else:
        fn = functools.partial(ragged_tpu.block_schedule, num_tokens=tokens, block_q=bq)
        args = (jnp.zeros(max_seqs + 1, jnp.int32), jnp.int32(1))
    assert "stablehlo.while" not in jax.jit(fn).lower(*args).as_text()
    # Same tables as a plain per-block scan of the sequence ends: ragged sequence lengths, idle rows at the end.
    q_lens = np.array([17, 0, 1, 33, 1, 12, 0, 0], np.int32)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    live = 6
    ends = np.cumsum(-(-q_lens[:live] // bq))
    nb = max(1, min(tokens, -(-tokens // bq) + max_seqs))
    want = [min(next((s for s, e in enumerate(ends) if e > g), max_seqs), max_seqs - 1) for g in range(nb)]
    if which == "gpu":
        got = np.asarray(fn(jnp.asarray(qsl), jnp.asarray(qsl[1:]), jnp.int32(live)))[:, 0]
    else:
        got = np.asarray(fn(jnp.asarray(qsl), jnp.int32(live))[0])
    used = np.arange(nb) < ends[-1]  # blocks past the last live one are padding, each kernel marks them its own way
    np.testing.assert_array_equal(got[used], np.asarray(want)[used])
