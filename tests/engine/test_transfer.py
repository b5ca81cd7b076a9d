"""Step inputs packed into two flat buffers come back out of the jitted step exactly, dtypes included."""

from __future__ import annotations

from functools import partial

import jax
import numpy as np
import pytest

from jaxinfer.engine.transfer import from_flat, to_flat
from jaxinfer.sampling import RowSampling, build_sampling_tensors
from jaxinfer.step import SeqChunk, pack


@pytest.mark.parametrize("advanced", [False, True])
def test_round_trip_through_jit(advanced):
    chunks = [SeqChunk([5, 6, 7], 0, [3]), SeqChunk([-2], 9, [1, 4], None), SeqChunk([8, 9], 4, [2], [9, -1])]
    inp = pack(chunks, 8, 4, 4, 8)
    extra = dict(top_k=5, repetition_penalty=1.2, logit_bias={4: -1.5}) if advanced else dict(min_p=0.1)
    rows = [RowSampling(temperature=0.7, seed=2**32 - 1, counter=3, prompt_ids=[1, 2], output_ids=[3], **extra),
            RowSampling(seed=2**31 + 7, top_p=0.5 if advanced else 1.0, logprobs=advanced)]  # fmt: skip
    st = build_sampling_tensors(rows, 4, 16, 4, advanced)
    flat, layout = to_flat((inp, st))
    assert flat[0].dtype == np.int32 and flat[1].dtype == np.float32
    assert hash(layout) == hash(to_flat((inp, st))[1])  # a static jit argument: same shapes, same layout

    @partial(jax.jit, static_argnames="layout")
    def identity(flat, layout):
        return from_flat(flat, layout)

    got = identity(jax.device_put(flat), layout)
    for want, have in zip(jax.tree.leaves((inp, st)), jax.tree.leaves(got), strict=True):
        assert np.asarray(want).dtype == np.asarray(have).dtype
        np.testing.assert_array_equal(np.asarray(want), np.asarray(have))


@pytest.mark.parametrize("dtype", [np.int64, np.float64, np.int8, np.float16])
def test_other_dtypes_are_refused_by_name(dtype):
    """Only the four dtypes a step's inputs use pack; anything else is an error naming it, not a silent cast."""
    with pytest.raises(TypeError, match=np.dtype(dtype).name):
        to_flat({"ok": np.zeros(2, np.int32), "bad": np.zeros(3, dtype)})


def test_layout_names_each_leaf_dtype_and_place():
    seeds = np.full((2, 2), 2**32 - 1, np.uint32)
    (ints, floats), layout = to_flat({"a": np.arange(3, dtype=np.float32), "b": np.array([True, False]), "c": seeds})
    # (buffer: 0 int32, 1 float32; offset; shape; dtype name)
    assert layout.leaves == ((1, 0, (3,), "float32"), (0, 0, (2,), "bool"), (0, 2, (2, 2), "uint32"))
    np.testing.assert_array_equal(ints, [1, 0, -1, -1, -1, -1])
    np.testing.assert_array_equal(floats, [0, 1, 2])
