"""The KV pool as the engine stores it (kernels_pallas.pool_shape): a token's heads side by side in one row, padded
to whole 128-lane rows on a TPU. The TPU kernels read the stored rows, padding included (interpret mode, against the
jnp reference on [.., Hkv, D] pools); every other kernel gets the [.., Hkv, D] view through the dispatcher; write_kv
fills the rows and zeroes their padding."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from paged_attention_cases import assert_close, make_decode_case, make_ragged_case

import kernels_pallas as kp
from kernels_pallas import decode_tpu, ragged_tpu, reference
from kernels_pallas.common import heads_view, pool_row_width, pool_shape


def _stored(pages: jax.Array, lane_multiple: int) -> jax.Array:
    """A [.., Hkv, D] pool as stored rows, the padding filled with NaN (a kernel must never read it into a result)."""
    p, s, h, d = pages.shape
    rows = jnp.full(pool_shape(p, s, h, d, lane_multiple), jnp.nan, pages.dtype)
    return rows.at[:, :, : h * d].set(pages.reshape(p, s, h * d))


@pytest.mark.parametrize(
    "kv_heads,shards,lanes,want",
    [(3, 1, 1, 192), (3, 1, 128, 256), (8, 1, 128, 512), (1, 1, 128, 128), (4, 2, 128, 256), (6, 2, 128, 512)],
)
def test_row_width_pads_each_shard(kv_heads, shards, lanes, want):
    # 6 heads of 64 over 2 shards: 3 heads (192) a shard, each padded to 256.
    assert pool_row_width(kv_heads, 64, lanes, shards) == want
    assert pool_shape(7, 16, kv_heads, 64, lanes, shards) == (7, 16, want)


# (head_dim, num_q_heads, num_kv_heads, page_size, dtype): SmolLM2's 9 / 3 x 64 (rows of 192 padded to 256), Gemma 3
# 270M's 4 / 1 x 256 (no padding), and a 2 x 64 case whose rows pad 128 -> 256 under lane_multiple 256.
CASES = [
    pytest.param(64, 9, 3, 16, jnp.float32, 128, id="smollm2-f32"),
    pytest.param(64, 9, 3, 16, jnp.bfloat16, 128, id="smollm2-bf16"),
    pytest.param(256, 4, 1, 8, jnp.bfloat16, 128, id="gemma3-bf16"),
    pytest.param(64, 4, 2, 8, jnp.float32, 256, id="d64-pad-a-whole-vreg"),
]


@pytest.mark.parametrize("head_dim,hq,hkv,page_size,dtype,lanes", CASES)
def test_tpu_decode_reads_padded_rows(head_dim, hq, hkv, page_size, dtype, lanes):
    case = make_decode_case(0, [0, 1, 2 * page_size, 3 * page_size + 5], num_q_heads=hq, num_kv_heads=hkv,
                            head_dim=head_dim, page_size=page_size, dtype=dtype)  # fmt: skip
    q, k, v, table, lengths = case.args()
    kw = dict(scale=head_dim**-0.5, sliding_window=2 * page_size - 3, soft_cap=None)
    want = reference.paged_decode_attention(q, k, v, table, lengths, **kw)
    got = decode_tpu.paged_decode_attention_rows(q, _stored(k, lanes), _stored(v, lanes), table, lengths,
                                                 num_kv_heads=hkv, interpret=True, **kw)  # fmt: skip
    assert got.shape == want.shape and got.dtype == dtype
    assert_close(got, np.asarray(want.astype(jnp.float32)), dtype)


@pytest.mark.parametrize("head_dim,hq,hkv,page_size,dtype,lanes", CASES)
def test_tpu_ragged_reads_padded_rows(head_dim, hq, hkv, page_size, dtype, lanes):
    case = make_ragged_case(1, [(5, 5), (1, 2 * page_size + 3), (7, 3 * page_size)], max_seqs=4, pad_tokens=3,
                            num_q_heads=hq, num_kv_heads=hkv, head_dim=head_dim, page_size=page_size,
                            dtype=dtype)  # fmt: skip
    q, k, v, *tables = case.args()
    kw = dict(scale=head_dim**-0.5, sliding_window=0, soft_cap=30.0)
    want = reference.ragged_paged_attention(q, k, v, *tables, **kw)
    got = ragged_tpu.ragged_paged_attention_rows(q, _stored(k, lanes), _stored(v, lanes), *tables,
                                                 num_kv_heads=hkv, interpret=True, **kw)  # fmt: skip
    assert_close(got, np.asarray(want.astype(jnp.float32)), dtype)


@pytest.mark.parametrize("impl", ["reference", "cpu", "cpu_jnp", "interpret_tpu"])
@pytest.mark.parametrize("lanes", [1, 128])
def test_dispatch_takes_stored_rows(impl, lanes):
    """Every implementation, given the stored rows (padded or not) and num_kv_heads, equals the reference on the
    [.., Hkv, D] pool: the TPU kernel reads the rows, the others a view (NaN padding would show if read)."""
    case = make_decode_case(2, [3, 17, 40], num_q_heads=6, num_kv_heads=3, head_dim=64, page_size=8)
    q, k, v, table, lengths = case.args()
    kw = dict(scale=0.125, sliding_window=0, soft_cap=None)
    want = reference.paged_decode_attention(q, k, v, table, lengths, **kw)
    fn = jax.jit(functools.partial(kp.paged_decode_attention, impl=impl, num_kv_heads=3, **kw))
    got = fn(q, _stored(k, lanes), _stored(v, lanes), table, lengths)
    assert_close(got, np.asarray(want), jnp.float32)


def test_stored_rows_need_the_head_count():
    case = make_decode_case(2, [3], num_q_heads=6, num_kv_heads=3, head_dim=64, page_size=8)
    q, k, v, table, lengths = case.args()
    with pytest.raises(ValueError, match="num_kv_heads"):
        kp.paged_decode_attention(q, _stored(k, 128), _stored(v, 128), table, lengths, scale=0.1, impl="reference")


@pytest.mark.parametrize("lanes", [1, 128])
def test_write_kv_fills_rows_and_zeroes_their_padding(lanes):
    rng = np.random.default_rng(4)
    pages = jnp.asarray(rng.standard_normal((5, 4, 3, 64)), jnp.float32)
    new = jnp.asarray(rng.standard_normal((3, 3, 64)), jnp.float32)
    slots = jnp.array([6, -1, 19], jnp.int32)  # page 1 slot 2, dropped, page 4 slot 3
    rows, _ = jax.jit(kp.write_kv)(_stored(pages, lanes), _stored(pages, lanes), new, new, slots)
    got = np.asarray(heads_view(rows, 3, 64)).reshape(20, 3, 64)
    want = np.asarray(pages).reshape(20, 3, 64).copy()
    want[6], want[19] = new[0], new[2]
    np.testing.assert_array_equal(got, want)
    flat = np.asarray(rows).reshape(20, -1)
    assert np.all(flat[[6, 19], 192:] == 0)  # the written rows' padding: zeros, not the NaN that was there
