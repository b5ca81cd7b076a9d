"""write_kv: scatter into the pool, padding slots dropped, donated pool updated in place."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import write_kv

NUM_PAGES, PAGE_SIZE, HKV, D = 5, 4, 2, 8
TOTAL = NUM_PAGES * PAGE_SIZE


def _pool(seed: int):
    rng = np.random.default_rng(seed)
    shape = (NUM_PAGES, PAGE_SIZE, HKV, D)
    return rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32)


def _expected(pool: np.ndarray, new: np.ndarray, slots: np.ndarray) -> np.ndarray:
    flat = pool.reshape(TOTAL, HKV, D).copy()
    for t, s in enumerate(slots):
        if 0 <= s < TOTAL:
            flat[s] = new[t]
    return flat.reshape(pool.shape)


def test_write_kv_scatters_and_drops_padding_slots():
    k_pool, v_pool = _pool(0)
    rng = np.random.default_rng(1)
    # Valid slots across pages (incl. the very first and last), plus padding: -1, == size, far out.
    slots = np.array([0, 7, -1, TOTAL - 1, TOTAL, 13, 1 << 20, -5], np.int32)
    k_new = rng.standard_normal((len(slots), HKV, D)).astype(np.float32)
    v_new = rng.standard_normal((len(slots), HKV, D)).astype(np.float32)
    k_out, v_out = jax.jit(write_kv)(k_pool, v_pool, k_new, v_new, slots)
    np.testing.assert_array_equal(np.asarray(k_out), _expected(k_pool, k_new, slots))
    np.testing.assert_array_equal(np.asarray(v_out), _expected(v_pool, v_new, slots))


def test_write_kv_casts_to_pool_dtype():
    k_pool, v_pool = (jnp.zeros((NUM_PAGES, PAGE_SIZE, HKV, D), jnp.bfloat16) for _ in range(2))
    new = jnp.ones((1, HKV, D), jnp.float32)
    k_out, _ = write_kv(k_pool, v_pool, new, new, jnp.array([5], jnp.int32))
    assert k_out.dtype == jnp.bfloat16
    assert float(k_out[1, 1].astype(jnp.float32).sum()) == HKV * D


def test_write_kv_with_donated_pool_is_in_place():
    k_ref, v_ref = _pool(2)
    # Fresh device buffers with no host views: on CPU a live numpy view of a buffer blocks its donation.
    k_pool, v_pool = jnp.array(k_ref, copy=True), jnp.array(v_ref, copy=True)
    slots = jnp.array([3, -1, 9], jnp.int32)
    new = jnp.full((3, HKV, D), 7.0, jnp.float32)

    fn = jax.jit(write_kv, donate_argnums=(0, 1))
    compiled = fn.lower(k_pool, v_pool, new, new, slots).compile()
    # Both pools are aliased to the outputs, and no pool-sized temporary is allocated.
    mem = compiled.memory_analysis()
    if mem is not None:
        assert mem.alias_size_in_bytes >= 2 * k_ref.nbytes
        assert mem.temp_size_in_bytes < k_ref.nbytes

    k_out, v_out = fn(k_pool, v_pool, new, new, slots)
    assert k_pool.is_deleted() and v_pool.is_deleted(), "donated pools must be consumed"
    np.testing.assert_array_equal(np.asarray(k_out), _expected(k_ref, np.asarray(new), np.asarray(slots)))
    np.testing.assert_array_equal(np.asarray(v_out), _expected(v_ref, np.asarray(new), np.asarray(slots)))
