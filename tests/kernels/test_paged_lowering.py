"""Lower the real (non-interpret) kernels for an H100 and a TPU on this CPU-only machine.

How: ``jax.jit(f).trace(*avals).lower()`` inside ``jax.sharding.use_abstract_mesh`` with an
``AbstractMesh`` whose ``AbstractDevice`` names the target platform. ``Traced.lower`` takes the lowering
platform from that device (equivalent to ``lower(lowering_platforms=(...,))``), and the Pallas TPU
lowering reads the chip generation from its ``device_kind`` -- without it, TPU lowering asks the
default (CPU) device and fails with "Unsupported TPU device kind: cpu". The mesh axes must be Explicit
for the abstract mesh to be recorded on the jit.

What this proves: the kernel bodies trace and pass the Python-side Pallas lowering (block-shape rules,
Triton's power-of-2 tensor rule, supported primitives) into the expected custom call. What it cannot:
PTX/Mosaic compilation and execution, which need the device toolchains (jax 0.10 hands Triton IR to
XLA:GPU at compile time; Mosaic MLIR is compiled by libtpu).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh

from kernels_pallas import decode_gpu, decode_tpu, ragged_gpu

H100 = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="cuda")
TPU_V5E = AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")
# Custom-call targets of the Pallas Triton lowering: jax <= 0.10.2 ships Triton IR to XLA:GPU, later
# versions compile to PTX at lowering time and call the Triton kernel FFI target.
TRITON_TARGETS = ("__gpu$xla.gpu.triton", "triton_kernel_call")


def _lower_on(device: AbstractDevice, fn, *avals) -> str:
    mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=device)
    with use_abstract_mesh(mesh):
        return jax.jit(fn).trace(*avals).lower().as_text()


def _lower_for_h100(fn, *avals) -> str:
    # A failure here is a failure, never a skip: jax is pinned to a version whose Triton lowering needs no GPU.
    return _lower_on(H100, fn, *avals)


def _decode_avals(dtype, head_dim=128, group=4, page_size=16):
    batch, hkv, num_pages, pages_per_seq = 8, 2, 64, 16
    return (
        jax.ShapeDtypeStruct((batch, hkv * group, head_dim), dtype),
        jax.ShapeDtypeStruct((num_pages, page_size, hkv, head_dim), dtype),
        jax.ShapeDtypeStruct((num_pages, page_size, hkv, head_dim), dtype),
        jax.ShapeDtypeStruct((batch, pages_per_seq), jnp.int32),
        jax.ShapeDtypeStruct((batch,), jnp.int32),
    )


@pytest.mark.parametrize(
    "dtype,num_splits,page_size",
    [(jnp.bfloat16, 1, 16), (jnp.bfloat16, 4, 8), (jnp.float32, 4, 16), (jnp.float16, 1, 64)],
)
def test_gpu_decode_kernel_lowers_for_h100(dtype, num_splits, page_size):
    # page_size 64 = block_kv: one page per KV block (the single-page gather path).
    fn = functools.partial(
        decode_gpu.paged_decode_attention, scale=0.1, sliding_window=64, soft_cap=30.0, num_splits=num_splits
    )
    text = _lower_for_h100(fn, *_decode_avals(dtype, page_size=page_size))
    assert any(t in text for t in TRITON_TARGETS), "expected a Triton custom call (not Mosaic GPU)"
    assert "mosaic_gpu" not in text


def test_gpu_ragged_kernel_lowers_for_h100():
    num_tokens, max_seqs = 64, 4
    q, k, v, pt, _ = _decode_avals(jnp.bfloat16, group=8, page_size=8)
    q = jax.ShapeDtypeStruct((num_tokens, *q.shape[1:]), q.dtype)
    pt = jax.ShapeDtypeStruct((max_seqs, pt.shape[1]), jnp.int32)
    ctx = jax.ShapeDtypeStruct((max_seqs,), jnp.int32)
    qsl = jax.ShapeDtypeStruct((max_seqs + 1,), jnp.int32)
    n = jax.ShapeDtypeStruct((), jnp.int32)
    fn = functools.partial(ragged_gpu.ragged_paged_attention, scale=0.1, sliding_window=32)
    text = _lower_for_h100(fn, q, k, v, pt, ctx, qsl, n)
    assert any(t in text for t in TRITON_TARGETS)


@pytest.mark.parametrize("dtype,head_dim", [(jnp.bfloat16, 128), (jnp.float32, 64)])
def test_tpu_decode_kernel_lowers_for_tpu(dtype, head_dim):
    fn = functools.partial(decode_tpu.paged_decode_attention, scale=0.1, sliding_window=40, soft_cap=30.0)
    text = _lower_on(TPU_V5E, fn, *_decode_avals(dtype, head_dim=head_dim))
    assert "tpu_custom_call" in text
