"""Static hardware budgets: a case over the SMEM, VMEM or int32 budget is an UnsupportedCase that the dispatcher turns
into a fallback with one warning per reason; the GPU decode split count does not depend on the batch size."""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from paged_attention_cases import make_decode_case

import kernels_pallas as kp
from kernels_pallas import UnsupportedCase, decode_gpu, decode_tpu, dispatch, ragged_tpu

S = jax.ShapeDtypeStruct


def _avals(tokens=8, hq=8, hkv=2, d=128, num_pages=64, page_size=16, rows=8, pages_per_seq=16, dtype=jnp.bfloat16):
    kv = S((num_pages, page_size, hkv, d), dtype)
    return S((tokens, hq, d), dtype), kv, kv, S((rows, pages_per_seq), jnp.int32)


# (what the guard is about, op, arguments): each over exactly one budget.
OVER_BUDGET = [
    ("SMEM", "decode", _avals(rows=512, pages_per_seq=256)),  # 131k page-table words
    ("SMEM", "ragged", _avals(tokens=256, rows=512, pages_per_seq=256)),
    ("VMEM", "decode", _avals(hq=8, hkv=8, d=2048, dtype=jnp.float32)),  # 8 pages x 8 heads x 2048 lanes, twice
    ("int32", "decode", _avals(num_pages=1 << 20)),  # 2^34 elements
    ("int32", "ragged", _avals(num_pages=1 << 20)),
]


@pytest.mark.parametrize("reason,op,avals", OVER_BUDGET, ids=[f"{r}-{o}" for r, o, _ in OVER_BUDGET])
def test_tpu_kernel_declines_over_budget(reason, op, avals):
    check = decode_tpu.check_supported if op == "decode" else ragged_tpu.check_supported
    check(*_avals())  # the same kernel takes the in-budget case
    with pytest.raises(UnsupportedCase, match=reason):
        check(*avals)


def test_gpu_kernel_declines_past_int32_offsets():
    q, kv, _, _ = _avals(num_pages=1 << 20)
    with pytest.raises(UnsupportedCase, match="int32"):
        decode_gpu.check_supported(q, kv, kv, 64)
    assert kp.decode_implementation(q, kv, kv, impl="pallas_gpu") == "reference"


def test_ragged_vmem_budget_names_vmem():
    q, kv, _, _ = _avals(tokens=256, hq=32, hkv=8, d=256)
    with pytest.raises(UnsupportedCase, match="VMEM"):
        ragged_tpu.check_supported(q, kv, kv, block_q=256, pages_per_step=64)


@pytest.fixture
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(dispatch, "_warned", set())


@pytest.mark.parametrize("reason,op,avals", OVER_BUDGET, ids=[f"{r}-{o}" for r, o, _ in OVER_BUDGET])
def test_dispatcher_falls_back_with_one_warning(reason, op, avals, fresh_warnings, caplog):
    q, k, v, table = avals
    pick = dispatch.decode_candidates if op == "decode" else dispatch.ragged_candidates
    with caplog.at_level(logging.WARNING, logger="kernels_pallas.dispatch"):
        for _ in range(3):  # every trace of a step picks again; the warning comes once
            assert dispatch._pick(pick("pallas_tpu"), (q, k, v, table), op).name == "reference"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and reason in warnings[0].getMessage() and "pallas_tpu" in warnings[0].getMessage()


def test_the_decode_call_warns_once_per_reason(fresh_warnings, caplog):
    """Through the public entry point under jit: head_dim 80 fits neither kernel; the GPU and TPU interpret kernels
    each warn once, with their own reason, however many times the op is traced."""
    case = make_decode_case(0, [3, 9], num_q_heads=4, num_kv_heads=2, head_dim=80, page_size=8)
    with caplog.at_level(logging.WARNING, logger="kernels_pallas.dispatch"):
        for scale in (0.1, 0.2):  # two traces
            jax.jit(functools.partial(kp.paged_decode_attention, scale=scale, impl="interpret"))(*case.args())
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(messages) == 2, messages
    assert any("pallas_gpu_interpret" in m and "head_dim=80" in m for m in messages)
    assert any("pallas_tpu_interpret" in m and "head_dim=80" in m for m in messages)


def test_explain_names_the_reason_without_warning(fresh_warnings, caplog):
    q, k, v, table = OVER_BUDGET[0][2]
    with caplog.at_level(logging.WARNING, logger="kernels_pallas.dispatch"):
        name, declined = dispatch.explain(dispatch.decode_candidates("pallas_tpu"), (q, k, v, table))
    assert name == "reference" and declined[0][0] == "pallas_tpu" and "SMEM" in declined[0][1]
    assert not caplog.records


# ---------------------------------------------------------------------------------------------- GPU split count


@pytest.mark.parametrize("num_blocks", [1, 7, 8, 17, 64, 1000])
def test_gpu_split_count_ignores_the_batch(num_blocks):
    import inspect

    assert list(inspect.signature(decode_gpu.default_num_splits).parameters) == ["num_blocks"]
    assert 1 <= decode_gpu.default_num_splits(num_blocks) <= max(1, num_blocks)


def test_gpu_decode_row_is_bitwise_the_same_alone_and_in_a_batch():
    """A row's flash-decoding partials are split and merged the same way at batch 1 and batch 4 (the table is wide
    enough for 2 splits), so its output is bit-for-bit identical: the batch invariance seeded sampling relies on."""
    case = make_decode_case(1, [250, 3, 100, 31], num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=8)
    q, k, v, table, lengths = case.args()
    num_blocks = -(-table.shape[1] // 2)  # block_kv 16 = 2 pages of 8
    assert decode_gpu.default_num_splits(num_blocks) == 2
    fn = jax.jit(functools.partial(decode_gpu.paged_decode_attention, scale=0.2, block_kv=16, interpret=True))
    batch = np.asarray(fn(q, k, v, table, lengths))
    for row in (0, 2):
        alone = np.asarray(fn(q[row : row + 1], k, v, table[row : row + 1], lengths[row : row + 1]))
        np.testing.assert_array_equal(alone[0], batch[row])
