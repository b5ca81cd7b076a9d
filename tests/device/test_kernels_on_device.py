"""Every attention kernel the dispatcher picks on this device against the jnp reference (run on the same device),
in bf16 and f32, at the engine's real head layouts (page size 16)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels_pallas as kp
from kernels_pallas import reference
from tests.kernels.paged_attention_cases import make_decode_case, make_ragged_case

# (query heads, KV heads, head dim, sliding window, soft cap) of the models the engine serves.
LAYOUTS = {
    "smollm2-135m": (9, 3, 64, 0, None),
    "gemma3-270m-sliding": (4, 1, 256, 512, None),
    "qwen3-0.6b": (16, 8, 128, 0, None),
    "llama3-8b": (32, 8, 128, 0, None),
    "capped": (8, 2, 128, 0, 30.0),
}
# Compiled kernels accumulate in another order than XLA's reference, and TPU f32 dots run in bf16 passes by default.
TOL = {jnp.float32: 5e-3, jnp.bfloat16: 3e-2}
DTYPES = [pytest.param(jnp.bfloat16, id="bf16"), pytest.param(jnp.float32, id="f32")]


def _close(out, expected, dtype):
    np.testing.assert_allclose(np.asarray(out.astype(jnp.float32)), np.asarray(expected.astype(jnp.float32)),
                               rtol=TOL[dtype], atol=TOL[dtype])  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_decode_kernel_on_device(layout, dtype):
    hq, hkv, d, window, cap = LAYOUTS[layout]
    lengths = [0, 1, 16, 700, 2048, 1500, 33, 5]  # empty, one token, a page, past the window, a full 2k context
    case = make_decode_case(0, lengths, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=16, dtype=dtype)
    args = case.args()
    assert kp.decode_implementation(*args[:3]) != "reference", "the dispatcher fell back to the reference"
    kw = dict(scale=d**-0.5, sliding_window=window, soft_cap=cap)
    out = jax.jit(lambda *a: kp.paged_decode_attention(*a, **kw))(*args)
    _close(out, reference.paged_decode_attention(*args, **kw), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_ragged_kernel_on_device(layout, dtype):
    hq, hkv, d, window, cap = LAYOUTS[layout]
    # (new tokens, context): a long prefill chunk, a continuation over a cached prefix, decodes, an idle row.
    seqs = [(200, 200), (64, 900), (1, 1), (1, 600), (0, 40), (17, 33)]
    case = make_ragged_case(0, seqs, max_seqs=8, pad_tokens=3, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                            page_size=16, dtype=dtype)  # fmt: skip
    args = case.args()
    assert kp.ragged_implementation(*args[:3]) != "reference", "the dispatcher fell back to the reference"
    kw = dict(scale=d**-0.5, sliding_window=window, soft_cap=cap)
    out = jax.jit(lambda *a: kp.ragged_paged_attention(*a, **kw))(*args)
    _close(out, reference.ragged_paged_attention(*args, **kw), dtype)
