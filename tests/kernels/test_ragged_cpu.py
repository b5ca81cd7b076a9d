"""The numba CPU attention kernel (kernels_pallas/ragged_cpu.py, called through XLA's FFI) against the float64
oracle and the jnp reference: decode rows and mixed steps (prefill chunks over cached prefixes, several query blocks
a chunk, decode tokens, padding tokens and rows), GQA groups, head dims, page sizes, ragged lengths (0, 1, page
multiples, the whole table), sliding windows, soft-cap, NaN in every slot a row does not own, garbage table entries
past a row's pages and garbage lengths and offsets past the live sequences."""

from __future__ import annotations

import logging
import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from paged_attention_cases import make_decode_case, make_ragged_case, naive_decode, naive_ragged

import kernels_pallas
from kernels_pallas import UnsupportedCase, dispatch, numba_ffi, ragged_cpu, reference

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="a CPU kernel")

# (head_dim, num_q_heads, num_kv_heads, page_size, sliding_window, soft_cap)
CASES = [
    (64, 9, 3, 16, 0, None),  # SmolLM2-135M
    (64, 8, 1, 8, 0, None),  # one KV head for all
    (128, 4, 4, 16, 0, None),  # no GQA
    (32, 6, 2, 4, 7, None),  # sliding window
    (256, 8, 2, 8, 0, 30.0),  # soft-cap (Gemma 2)
    (256, 4, 1, 16, 0, None),  # Gemma 3 270M's heads at the engine's page size
    (64, 4, 2, 16, 20, 5.0),  # both
    # The specialized head dim (64) at the engine's page size, across item shapes:
    (64, 32, 4, 16, 0, None),  # 32 rows an item (eight passes of four rows)
    (64, 16, 1, 16, 40, None),  # a group of 16 on one KV head; the window starts inside a page
    (64, 6, 6, 16, 0, None),  # no GQA: one row a head
]


def _attend(case, **opts):
    return jax.jit(lambda *a: ragged_cpu.paged_decode_attention(*a, **opts))(*case.args())


def _f32_queries(args: tuple) -> tuple:
    """A case's operands with its queries as float32 (exact: they were rounded to the pool's dtype), as the engine
    calls the kernel over a float16 pool."""
    return (args[0].astype(jnp.float32), *args[1:])


@pytest.mark.parametrize("pool_dtype", [jnp.float32, jnp.float16])
@pytest.mark.parametrize("head_dim,hq,hkv,page_size,window,soft_cap", CASES)
def test_decode_matches_oracle_and_reference(head_dim, hq, hkv, page_size, window, soft_cap, pool_dtype):
    """Float16 pools too: the kernel widens the halves on load, and otherwise computes what it does in float32 (the
    oracle sees the same rounded values)."""
    ps = page_size
    lengths = [0, 1, 2 * ps, 2 * ps + 3, ps - 1, 7 * ps + 5, 3]
    case = make_decode_case(0, lengths, num_q_heads=hq, num_kv_heads=hkv, head_dim=head_dim, page_size=ps,
                            dtype=pool_dtype)  # fmt: skip
    opts = dict(scale=head_dim**-0.5, sliding_window=window, soft_cap=soft_cap)
    args = _f32_queries(case.args())
    assert args[1].dtype == pool_dtype
    out = jax.jit(lambda *a: ragged_cpu.paged_decode_attention(*a, **opts))(*args)
    assert out.shape == case.q.shape and out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), naive_decode(case, **opts), rtol=1e-5, atol=1e-5)
    ref = jax.jit(lambda *a: reference.paged_decode_attention(*a, **opts))(*args)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)
    assert not np.any(np.asarray(out[0])), "a length-0 row is exactly zero"


@pytest.mark.parametrize("pool_dtype", [jnp.float32, jnp.float16])
@pytest.mark.parametrize("hq,hkv,window", [(9, 3, 0), (32, 4, 0), (8, 2, 100)])
def test_decode_items_of_one_kv_head_match_the_oracle(hq, hkv, window, pool_dtype):
    """Two long decodes on two threads: each item is one KV head of one token (the kernel's split when there are
    fewer decodes than two a thread), windowed or not."""
    case = make_decode_case(3, [3000, 16 * 190 + 9], num_q_heads=hq, num_kv_heads=hkv, head_dim=64, page_size=16,
                            dtype=pool_dtype)  # fmt: skip
    opts = dict(scale=0.125, sliding_window=window, soft_cap=None)
    out = jax.jit(lambda *a: ragged_cpu.paged_decode_attention(*a, **opts))(*_f32_queries(case.args()))
    np.testing.assert_allclose(np.asarray(out), naive_decode(case, **opts), rtol=1e-5, atol=1e-5)


# (q_len, context_len): chunks of several query blocks (BLOCK_Q = 16) over cached prefixes, a whole prompt, decodes,
# an empty sequence.
MIXED = [(40, 40), (5, 21), (1, 9), (1, 1), (17, 50), (0, 4), (33, 70), (1, 64)]


@pytest.mark.parametrize("pool_dtype", [jnp.float32, jnp.float16])
@pytest.mark.parametrize("head_dim,hq,hkv,page_size,window,soft_cap", CASES)
def test_mixed_step_matches_oracle_and_reference(head_dim, hq, hkv, page_size, window, soft_cap, pool_dtype):
    case = make_ragged_case(1, MIXED, max_seqs=len(MIXED) + 2, pad_tokens=3, num_q_heads=hq, num_kv_heads=hkv,
                            head_dim=head_dim, page_size=page_size, dtype=pool_dtype)  # fmt: skip
    opts = dict(scale=head_dim**-0.5, sliding_window=window, soft_cap=soft_cap)
    args = _f32_queries(case.args())
    out = jax.jit(lambda *a: ragged_cpu.ragged_paged_attention(*a, **opts))(*args)
    assert out.shape == case.q.shape and out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), naive_ragged(case, **opts), rtol=1e-5, atol=1e-5)
    ref = jax.jit(lambda *a: reference.ragged_paged_attention(*a, **opts))(*args)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)
    assert not np.any(np.asarray(out[-3:])), "padding tokens are exactly zero"


def test_mixed_step_with_no_live_sequences_is_zero():
    case = make_ragged_case(2, [(3, 5)], max_seqs=2, pad_tokens=2, num_q_heads=2, num_kv_heads=1, head_dim=64,
                            page_size=8)  # fmt: skip
    args = list(case.args())
    args[-1] = jnp.int32(0)
    assert not np.any(np.asarray(jax.jit(lambda *a: ragged_cpu.ragged_paged_attention(*a, scale=0.125))(*args)))


def test_ragged_cpu_lengths_past_the_table_stop_at_its_end():
    """A length beyond the table's width attends the table's keys only (as the jnp paths: keys past the table do not
    exist), never a slot outside the row's pages."""
    case = make_decode_case(1, [16, 5], num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=4)
    expected = naive_decode(case, scale=0.125, sliding_window=0, soft_cap=None)
    q, k, v, table, _ = case.args()
    lens = jnp.asarray([16 + 50, 5], jnp.int32)  # the table without its spare (garbage) column holds 16 keys
    out = jax.jit(lambda *a: ragged_cpu.paged_decode_attention(*a, scale=0.125))(q, k, v, table[:, :4], lens)
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-5, atol=1e-5)


def test_ragged_cpu_out_of_range_page_ids_never_read_outside_the_pool():
    """Page ids past the pool (or negative) inside a row's length are a caller's bug: the kernel clamps them into
    the pool rather than reading foreign memory, so the process survives."""
    case = make_decode_case(2, [9, 6], num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=4)
    case.pool.page_table[0, 0] = 1 << 30
    case.pool.page_table[1, 1] = -(1 << 30)
    out = _attend(case, scale=0.125)
    assert out.shape == case.q.shape


@pytest.mark.parametrize("pool_dtype", [jnp.float32, jnp.float16])
@pytest.mark.parametrize("head_dim", [64, 16])
def test_ragged_cpu_rows_do_not_depend_on_the_batch(head_dim, pool_dtype):
    """Each row is computed alone: the same row gives the same bits alone (a small call, on the calling thread) and
    in a batch (a large one, on numba's threads), and matches the oracle either way; on both handlers and pools."""
    from kernels_pallas import ragged_cpu_numba

    lengths = [370, 5, 640, 1, 1000, 170, 0, 800, 3000]
    assert sum(lengths) * 9 >= ragged_cpu_numba._SERIAL_WORK, "the batch must be large enough for the threads"
    case = make_decode_case(3, lengths, num_q_heads=9, num_kv_heads=3, head_dim=head_dim, page_size=16,
                            dtype=pool_dtype)  # fmt: skip
    q, k, v, table, lens = _f32_queries(case.args())
    full = np.asarray(jax.jit(lambda *a: ragged_cpu.paged_decode_attention(*a, scale=0.125))(q, k, v, table, lens))
    np.testing.assert_allclose(full, naive_decode(case, scale=0.125, sliding_window=0, soft_cap=None), rtol=1e-5,
                               atol=1e-5)  # fmt: skip
    for r in (0, 4):
        alone = jax.jit(lambda *a: ragged_cpu.paged_decode_attention(*a, scale=0.125))(
            q[r : r + 1], k, v, table[r : r + 1], lens[r : r + 1]
        )
        np.testing.assert_array_equal(np.asarray(alone)[0], full[r])


@pytest.mark.parametrize("threads", [1, 3, 64])
def test_ragged_cpu_thread_count_changes_no_bits(monkeypatch, threads):
    """1 thread: every item on the calling thread; 2 (the default here): each decode with all its KV heads; 3 and
    64 (fewer decodes than two per thread): each decode's KV heads on their own."""
    from kernels_pallas import ragged_cpu_numba

    lengths = [370, 5, 640, 1, 3700]
    assert sum(lengths) * 9 >= ragged_cpu_numba._SERIAL_WORK, "the call must be large enough for the threads"
    case = make_decode_case(4, lengths, num_q_heads=9, num_kv_heads=3, head_dim=64, page_size=16)
    base = np.asarray(_attend(case, scale=0.125))
    monkeypatch.setattr(numba_ffi, "num_threads", lambda: threads)
    np.testing.assert_array_equal(np.asarray(_attend(case, scale=0.125)), base)


@pytest.mark.parametrize("pool_dtype,suffix", [(jnp.float32, ""), (jnp.float16, "_f16")])
@pytest.mark.parametrize("head_dim,handler", [(64, "_d64"), (128, "_any"), (32, "_any"), (256, "_any")])
def test_head_dim_64_has_its_own_handler_and_the_others_share_one(head_dim, handler, pool_dtype, suffix):
    """64 (the default model's) runs the handler compiled with it as a constant; every other head dim runs the one
    that reads it from q; each pool dtype has its own pair. CASES covers all four against the oracle."""
    case = make_decode_case(7, [5, 20], num_q_heads=4, num_kv_heads=2, head_dim=head_dim, page_size=16,
                            dtype=pool_dtype)  # fmt: skip
    fn = jax.jit(lambda *a: ragged_cpu.paged_decode_attention(*a, scale=0.125))
    assert f"@{ragged_cpu.TARGET}{handler}{suffix}(" in fn.lower(*_f32_queries(case.args())).as_text()


def test_threads_that_reach_a_target_together_build_and_register_it_once():
    """The engine traces its steps on a thread pool: threads that ask for a target at once wait for one build, and
    the registered cfunc (whose machine code XLA calls) is the one kept."""
    from kernels_pallas import ragged_cpu_numba

    name, builds, start = f"jaxinfer_test_target_{os.getpid()}", [], threading.Barrier(4)

    def build():
        builds.append(ragged_cpu_numba.handler(64))
        time.sleep(0.2)  # the other threads arrive during the build
        return builds[-1]

    def first_use():
        start.wait()
        numba_ffi.register(name, build)

    threads = [threading.Thread(target=first_use) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(builds) == 1 and numba_ffi._handlers[name] is builds[0]


def test_ragged_cpu_declines_what_it_does_not_run():
    q = jnp.zeros((2, 4, 64), jnp.bfloat16)
    pages = jnp.zeros((8, 16, 2, 64), jnp.bfloat16)
    with pytest.raises(UnsupportedCase, match="float32"):
        ragged_cpu.check_supported(q, pages, pages)
    with pytest.raises(UnsupportedCase, match="pools"):  # float32 queries, a bfloat16 pool
        ragged_cpu.check_supported(q.astype(jnp.float32), pages, pages)
    with pytest.raises(UnsupportedCase, match="of one dtype"):
        ragged_cpu.check_supported(q.astype(jnp.float32), pages.astype(jnp.float16), pages.astype(jnp.float32))
    with pytest.raises(UnsupportedCase, match="q is float16"):
        ragged_cpu.check_supported(q.astype(jnp.float16), pages.astype(jnp.float16), pages.astype(jnp.float16))
    with pytest.raises(UnsupportedCase, match="multiple"):
        ragged_cpu.check_supported(jnp.zeros((2, 3, 64)), jnp.zeros((8, 16, 2, 64)), jnp.zeros((8, 16, 2, 64)))


@pytest.mark.parametrize("impl", ["cpu", "cpu_jnp"])
def test_dispatcher_runs_the_kernel_for_both_ops_on_cpu(impl):
    """On CPU the dispatcher's decode and mixed steps call the FFI kernel ("cpu"), or the jnp loops ("cpu_jnp"); both
    give the oracle's answer."""
    opts = dict(scale=0.125, sliding_window=0, soft_cap=None)
    case = make_decode_case(5, [0, 3, 40, 17], num_q_heads=9, num_kv_heads=3, head_dim=64, page_size=16)
    assert kernels_pallas.decode_implementation(*case.args()[:3], impl=impl) == ("cpu_numba" if impl == "cpu" else
                                                                                  "cpu_jnp")  # fmt: skip
    fn = jax.jit(lambda *a: kernels_pallas.paged_decode_attention(*a, **opts, impl=impl))
    assert (ragged_cpu.TARGET in fn.lower(*case.args()).as_text()) == (impl == "cpu")
    np.testing.assert_allclose(np.asarray(fn(*case.args())), naive_decode(case, **opts), rtol=1e-5, atol=1e-5)
    mixed = make_ragged_case(5, MIXED, max_seqs=len(MIXED), pad_tokens=1, num_q_heads=9, num_kv_heads=3, head_dim=64,
                             page_size=16)  # fmt: skip
    fn = jax.jit(lambda *a: kernels_pallas.ragged_paged_attention(*a, **opts, impl=impl))
    assert (ragged_cpu.TARGET in fn.lower(*mixed.args()).as_text()) == (impl == "cpu")
    np.testing.assert_allclose(np.asarray(fn(*mixed.args())), naive_ragged(mixed, **opts), rtol=1e-5, atol=1e-5)


def test_without_the_kernel_the_dispatcher_warns_once_and_uses_jnp(monkeypatch, caplog):
    """Where numba is missing or finds no thread-safe threading layer, the dispatcher says so once and runs jnp."""
    monkeypatch.setattr(ragged_cpu, "unavailable", lambda head_dim, kv_dtype="float32": "numba is not installed")
    monkeypatch.setattr(dispatch, "_warned", set())
    case = make_decode_case(6, [3, 40], num_q_heads=9, num_kv_heads=3, head_dim=64, page_size=16)
    opts = dict(scale=0.125, sliding_window=0, soft_cap=None)
    with caplog.at_level(logging.WARNING, logger="kernels_pallas.dispatch"):
        fn = jax.jit(lambda *a: kernels_pallas.paged_decode_attention(*a, **opts, impl="cpu"))
        hlo = fn.lower(*case.args()).as_text()
        jax.jit(lambda *a: kernels_pallas.paged_decode_attention(*a, **opts, impl="cpu")).lower(*case.args())
    assert ragged_cpu.TARGET not in hlo
    assert caplog.text.count("numba is not installed") == 1 and "cpu_numba declined" in caplog.text
    assert kernels_pallas.decode_implementation(*case.args()[:3], impl="cpu") == "cpu_jnp"
    np.testing.assert_allclose(np.asarray(fn(*case.args())), naive_decode(case, **opts), rtol=1e-5, atol=1e-5)
    with pytest.raises(UnsupportedCase, match="numba is not installed"):
        ragged_cpu.paged_decode_attention(*case.args(), scale=0.125)


def test_the_kernels_exp_is_within_float32_rounding():
    """The softmax's written-out exp (vectorizable, unlike expf) against numpy's float64 exp over its range."""
    from numba import njit

    from kernels_pallas.ragged_cpu_numba import _exp

    @njit(fastmath=True)
    def each(xs, out):
        for i in range(xs.shape[0]):
            out[i] = _exp(xs[i])

    xs = np.concatenate([np.linspace(-87, 0, 200_001), [-1e-30, 0.0]]).astype(np.float32)
    out = np.empty_like(xs)
    each(xs, out)
    exact = np.exp(xs.astype(np.float64))
    assert np.max(np.abs(out - exact) / exact) < 2e-7
