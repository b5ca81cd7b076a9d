"""The TPU ragged paged-attention kernel (kernels_pallas/ragged_tpu.py): interpret mode on CPU against the
jnp reference, the TPU-faithful interpreter (simulated DMAs/semaphores), lowering to Mosaic for a TPU
v5e, and its place in the dispatcher.

Interpret mode compiles one XLA program per static configuration (~3 s of CPU each), so the shape
matrix is a representative subset (every head dim / GQA ratio / page size / option appears at least
once), and the ragged-layout variety is run against a single compiled configuration (padded to common
shapes, so every layout reuses one executable).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh
from paged_attention_cases import KERNEL_TOL, RaggedCase, assert_close, make_ragged_case

import kernels_pallas as kp
from kernels_pallas import UnsupportedCase, ragged_tpu, reference

_reference = jax.jit(reference.ragged_paged_attention, static_argnames=("scale", "sliding_window", "soft_cap"))

# (head_dim, num_q_heads, num_kv_heads, page_size, sliding_window, soft_cap, dtype, block_q, pages_per_step)
CASES = [
    # head_dim 64 with 2 KV heads: the 128-lane window holding both heads; 2 pages per KV step.
    pytest.param(64, 2, 2, 8, 0, None, jnp.float32, 4, 2, id="d64-g1-ps8-pps2"),
    # A page size that is not a power of 2 (24 % 8 == 0: still stackable, 2 pages per step); soft cap.
    pytest.param(128, 3, 1, 24, 0, 5.0, jnp.float32, 8, 2, id="d128-g3-ps24-pps2-cap"),
    # bf16 with page_size 8 < its 16-row sublane tile: one page per step (the default picks it).
    pytest.param(64, 8, 1, 8, 6, 30.0, jnp.bfloat16, 2, None, id="d64-g8-ps8-win-cap-bf16"),
    pytest.param(256, 4, 1, 16, 9, None, jnp.bfloat16, 4, None, id="d256-g4-ps16-win-bf16"),
    # Default block sizes; bf16 head_dim 64 lane windows with 2 KV heads; a window spanning pages.
    pytest.param(64, 16, 2, 16, 20, None, jnp.bfloat16, None, None, id="d64-g8-ps16-win-bf16-defaults"),
    # The default model's layout (SmolLM2: 9 query / 3 KV heads of 64): the last window is half padding.
    pytest.param(64, 9, 3, 16, 0, None, jnp.bfloat16, None, None, id="d64-g3-hkv3-ps16-bf16"),
]

# (q_len, context_len): full prefill over several query blocks, a chunked-prefill continuation over a
# cached prefix spanning several KV steps, decode tokens, a 1-token sequence, an idle live row, and a
# page-multiple context. Plus one padding row (max_seqs = 7) and two padding tokens.
SEQS = [(11, 11), (6, 37), (1, 9), (1, 1), (0, 5), (2, 16)]
PAD_TOKENS = 2


def _case(seqs, *, head_dim, hq, hkv, page_size, dtype=jnp.float32, max_seqs=None, pad_tokens=PAD_TOKENS, seed=1):
    return make_ragged_case(
        seed,
        seqs,
        max_seqs=max_seqs or len(seqs) + 1,
        pad_tokens=pad_tokens,
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=head_dim,
        page_size=page_size,
        dtype=dtype,
    )


def _check(case: RaggedCase, out, expected) -> None:
    assert out.shape == expected.shape and out.dtype == case.dtype
    assert_close(out, np.asarray(expected.astype(jnp.float32)), case.dtype)
    num_valid = int(case.query_start_loc[case.num_seqs]) if case.num_seqs else 0
    assert not np.any(np.asarray(out[num_valid:].astype(jnp.float32))), "padding tokens must be exactly zero"


@pytest.mark.parametrize("head_dim,hq,hkv,page_size,window,soft_cap,dtype,block_q,pps", CASES)
def test_ragged_tpu_kernel_matches_reference(head_dim, hq, hkv, page_size, window, soft_cap, dtype, block_q, pps):
    case = _case(SEQS, head_dim=head_dim, hq=hq, hkv=hkv, page_size=page_size, dtype=dtype)
    kw = dict(scale=head_dim**-0.5, sliding_window=window, soft_cap=soft_cap)
    # Only name the sizes a case sets, so the defaults case shares its compiled kernel with the dispatcher test.
    sizes = {k: v for k, v in dict(block_q=block_q, pages_per_step=pps).items() if v is not None}
    out = ragged_tpu.ragged_paged_attention(*case.args(), **kw, **sizes, interpret=True)
    _check(case, out, _reference(*case.args(), **kw))


# --- many ragged layouts, one compiled configuration ------------------------------------------------

LAYOUT_SHAPE = dict(num_tokens=24, max_seqs=5, pages_per_seq=7, num_pages=5 * 7 + 3)
# (seqs, num_seqs override or None)
LAYOUTS = {
    "all-decode": ([(1, 1), (1, 8), (1, 9), (1, 17), (1, 40)], None),
    "one-long-prefill": ([(20, 20)], None),
    "long-prefix-short-chunk": ([(3, 44), (7, 7)], None),
    "empty-rows-between": ([(0, 12), (5, 13), (0, 3), (2, 2)], None),
    "num_seqs-below-filled-rows": ([(2, 10), (3, 3), (4, 30), (1, 6)], 2),
    "no-live-seqs": ([(4, 9), (2, 2)], 0),
}


def _pad_case(case: RaggedCase, *, num_tokens, max_seqs, pages_per_seq, num_pages) -> RaggedCase:
    """Pad to fixed shapes: NaN padding tokens and pool pages, garbage page-table columns."""
    assert case.pool.page_table.shape[0] == max_seqs
    q = np.concatenate([case.q, np.full((num_tokens - case.q.shape[0], *case.q.shape[1:]), np.nan, np.float32)])
    extra = num_pages - case.pool.k_pages.shape[0]
    nan_pages = np.full((extra, *case.pool.k_pages.shape[1:]), np.nan, np.float32)
    cols = pages_per_seq - case.pool.page_table.shape[1]
    pool = dataclasses.replace(
        case.pool,
        k_pages=np.concatenate([case.pool.k_pages, nan_pages]),
        v_pages=np.concatenate([case.pool.v_pages, nan_pages]),
        page_table=np.pad(case.pool.page_table, ((0, 0), (0, cols)), constant_values=-1),
    )
    return dataclasses.replace(case, q=q, pool=pool)


def test_ragged_tpu_kernel_layouts():
    # A window of 12 with 16-token KV steps: long contexts skip their first steps entirely and start
    # mid-step; window 0 (full causal walk) is covered by CASES.
    kw = dict(scale=0.125, sliding_window=12, soft_cap=None)
    kernel = functools.partial(ragged_tpu.ragged_paged_attention, **kw, block_q=4, pages_per_step=2, interpret=True)
    shape = dict(LAYOUT_SHAPE)
    for name, (seqs, num_seqs) in LAYOUTS.items():
        case = _case(seqs, head_dim=128, hq=4, hkv=2, page_size=8, max_seqs=shape["max_seqs"], pad_tokens=0)
        case = _pad_case(case, **shape)
        if num_seqs is not None:
            case = dataclasses.replace(case, num_seqs=num_seqs)
        out = kernel(*case.args())
        try:
            _check(case, out, _reference(*case.args(), **kw))
        except AssertionError as e:
            raise AssertionError(f"layout {name!r}: {e}") from e
        if name == "all-decode":
            np.testing.assert_array_equal(np.asarray(out), np.asarray(kernel(*case.args())), "not deterministic")


@pytest.mark.parametrize("head_dim,hq,hkv", [(128, 8, 2), (64, 9, 3)])
def test_ragged_tpu_kernel_under_tpu_interpreter(head_dim, hq, hkv):
    # The TPU interpreter simulates the HBM -> VMEM DMAs and their semaphores: DMAs land only when waited
    # on ("on_wait"), scratch starts as NaN, and the race detector flags reads of a buffer while a DMA into
    # it is in flight -- so a missing/misplaced wait or a wrong double-buffer slot shows up here. With 3 KV
    # heads of 64 the padded lanes of the last window start as NaN too: they must be zeroed before use.
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interp  # private: race flag

    case = _case(SEQS, head_dim=head_dim, hq=hq, hkv=hkv, page_size=16, dtype=jnp.bfloat16, seed=3)
    kw = dict(scale=head_dim**-0.5, sliding_window=12, soft_cap=None)
    params = pltpu.InterpretParams(detect_races=True, dma_execution_mode="on_wait", uninitialized_memory="nan")
    out = ragged_tpu.ragged_paged_attention(*case.args(), **kw, block_q=4, pages_per_step=2, interpret=params)
    out.block_until_ready()
    _check(case, out, _reference(*case.args(), **kw))
    races = getattr(tpu_interp, "races", None)
    if races is not None:
        assert not races.races_found, "race detector flagged a DMA/compute race"


def test_ragged_tpu_check_supported():
    def shapes(head_dim=128, hq=8, hkv=2, page_size=16, dtype=jnp.float32, kv_dtype=None):
        q = jax.ShapeDtypeStruct((16, hq, head_dim), dtype)
        kv = jax.ShapeDtypeStruct((8, page_size, hkv, head_dim), kv_dtype or dtype)
        return q, kv, kv

    ragged_tpu.check_supported(*shapes())
    ragged_tpu.check_supported(*shapes(head_dim=64, hkv=1, hq=3))
    ragged_tpu.check_supported(*shapes(head_dim=64, hkv=3, hq=9))  # odd KV heads (the default model): padded window
    ragged_tpu.check_supported(*shapes(head_dim=256, page_size=24, dtype=jnp.bfloat16))  # 1 page per step
    for bad, kw in [
        (shapes(head_dim=80), {}),  # not lane aligned
        (shapes(dtype=jnp.bfloat16, kv_dtype=jnp.float32), {}),
        (shapes(dtype=jnp.float16), {}),
        (shapes(), dict(block_q=6)),
        (shapes(page_size=24, dtype=jnp.bfloat16), dict(pages_per_step=2)),  # 24 % 16 != 0
    ]:
        with pytest.raises(UnsupportedCase):
            ragged_tpu.check_supported(*bad, **kw)


def test_dispatcher_uses_the_tpu_kernel():
    q = jax.ShapeDtypeStruct((4, 8, 128), jnp.float32)
    kv = jax.ShapeDtypeStruct((6, 16, 2, 128), jnp.float32)
    assert kp.ragged_implementation(q, kv, kv, impl="pallas_tpu") == "pallas_tpu"
    assert kp.ragged_implementation(q, kv, kv, impl="interpret_tpu") == "pallas_tpu_interpret"
    q80, kv80 = jax.ShapeDtypeStruct((4, 8, 80), jnp.float32), jax.ShapeDtypeStruct((6, 16, 2, 80), jnp.float32)
    assert kp.ragged_implementation(q80, kv80, kv80, impl="pallas_tpu") == "reference"

    # Same static configuration as the "defaults" CASES entry, so this reuses its compiled kernel.
    case = _case(SEQS, head_dim=64, hq=16, hkv=2, page_size=16, dtype=jnp.bfloat16)
    kw = dict(scale=0.125, sliding_window=20)
    out = kp.ragged_paged_attention(*case.args(), **kw, impl="interpret_tpu")
    _check(case, out, _reference(*case.args(), **kw, soft_cap=None))


# --- lowering for a real TPU (no hardware needed) -----------------------------------------------------

TPU_V5E = AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")


def _lower_for_tpu(fn, *avals) -> str:
    # As in test_paged_lowering: the abstract TPU device gives the lowering platform and chip generation.
    mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=TPU_V5E)
    with use_abstract_mesh(mesh):
        return jax.jit(fn).trace(*avals).lower().as_text()


@pytest.mark.parametrize(
    "dtype,head_dim,hkv,group,page_size",
    [(jnp.bfloat16, 128, 2, 4, 16), (jnp.float32, 64, 2, 1, 8), (jnp.bfloat16, 256, 1, 8, 8)],
)
def test_ragged_tpu_kernel_lowers_for_tpu(dtype, head_dim, hkv, group, page_size):
    num_tokens, max_seqs, pages_per_seq, num_pages = 64, 4, 16, 64
    avals = (
        jax.ShapeDtypeStruct((num_tokens, hkv * group, head_dim), dtype),
        jax.ShapeDtypeStruct((num_pages, page_size, hkv, head_dim), dtype),
        jax.ShapeDtypeStruct((num_pages, page_size, hkv, head_dim), dtype),
        jax.ShapeDtypeStruct((max_seqs, pages_per_seq), jnp.int32),
        jax.ShapeDtypeStruct((max_seqs,), jnp.int32),
        jax.ShapeDtypeStruct((max_seqs + 1,), jnp.int32),
        jax.ShapeDtypeStruct((), jnp.int32),
    )
    fn = functools.partial(ragged_tpu.ragged_paged_attention, scale=0.1, sliding_window=40, soft_cap=30.0)
    text = _lower_for_tpu(fn, *avals)
    assert "tpu_custom_call" in text


# --- on-device: skipped on this CPU machine, runs by itself on a TPU machine -------------------------


@pytest.mark.skipif(jax.default_backend() != "tpu", reason="needs a TPU to run the compiled Mosaic kernel")
@pytest.mark.parametrize("head_dim,hq,hkv,page_size,window,soft_cap,dtype,block_q,pps", CASES)
def test_ragged_tpu_kernel_on_device(head_dim, hq, hkv, page_size, window, soft_cap, dtype, block_q, pps):
    case = _case(SEQS, head_dim=head_dim, hq=hq, hkv=hkv, page_size=page_size, dtype=dtype)
    kw = dict(scale=head_dim**-0.5, sliding_window=window, soft_cap=soft_cap)
    out = ragged_tpu.ragged_paged_attention(*case.args(), **kw, block_q=block_q, pages_per_step=pps)
    expected = reference.ragged_paged_attention(*case.args(), **kw)
    # Compiled kernels accumulate in a different order than XLA's reference: loosen f32 a little.
    rtol, atol = (1e-4, 1e-4) if dtype == jnp.float32 else KERNEL_TOL[dtype]
    np.testing.assert_allclose(
        np.asarray(out.astype(jnp.float32)), np.asarray(expected.astype(jnp.float32)), rtol=rtol, atol=atol
    )
