"""Real compiles, at the engine's real shapes, for TPU (libtpu: XLA:TPU + Mosaic) and H100 (Triton -> sm_90a cubin),
on this CPU-only machine. Lowering alone proves little: tiling, VMEM/SMEM, register and shared-memory limits are
only checked when the real compiler runs.

Run them with the tools of the `aot` extra, kept in their own virtualenv (CI does this):

    bash scripts/install.sh aot && .venv-aot/bin/python -m pytest -q tests/aot

Each case compiles one layer of each kind the model has (the kernels' shapes do not depend on the depth), with the
KV pool sized the way the engine sizes it on that device (half the memory the full model's weights leave free), the
engine's default max_num_seqs / max_num_batched_tokens buckets and a 4096-token context. Every compiled module must
contain the intended Pallas kernel once per layer; a fallback to the jnp reference fails the test.
"""

from __future__ import annotations

import functools
import math
import os
import re

import jax
import jax.numpy as jnp
import pytest
from aot_tools import (
    H100_HBM_BYTES,
    H100_MAX_SHARED_BYTES,
    KERNEL_NAMES,
    TPU_TOPOLOGIES,
    StepCase,
    compile_for_h100,
    compile_for_tpu,
    copies_of,
    h100_step_kernels,
    have_libtpu,
    have_triton,
    lower_for_h100,
    pool_pages,
    step_args,
    tpu_devices,
    tpu_kernel_calls,
)

from benchmarks.common import SHAPES
from jaxinfer.config import ModelConfig, RopeConfig
from jaxinfer.engine import runner as runner_module
from jaxinfer.engine.config import CacheConfig
from jaxinfer.engine.runner import paged_step, pool_shape
from jaxinfer.model import layers
from kernels_pallas import decode_gpu, decode_tpu
from tests.control_flow import host_synced_control_flow

_HOW = "the AOT compilers live in .venv-aot: `bash scripts/install.sh aot && .venv-aot/bin/python -m pytest tests/aot`"
needs_libtpu = pytest.mark.skipif(not have_libtpu(), reason=f"libtpu missing; {_HOW}")
needs_triton = pytest.mark.skipif(not have_triton(), reason=f"triton missing; {_HOW}")

# Gemma 3 270M (google/gemma-3-270m config.json): one KV head of 256, every 6th layer global, the rest slide.
GEMMA3_270M = dict(
    arch="gemma3", vocab_size=262144, hidden_size=640, intermediate_size=2048, num_layers=18, num_heads=4,
    num_kv_heads=1, head_dim=256, norm_eps=1e-6, max_position_embeddings=32768, tie_word_embeddings=True,
    qk_norm=True, activation="gelu_tanh", norm_offset=1.0, embed_scale=True, sandwich_norm=True,
    layer_windows=tuple(0 if (i + 1) % 6 == 0 else 512 for i in range(18)), query_scale=256**-0.5,
    rope=RopeConfig(theta=1_000_000.0), rope_local=RopeConfig(theta=10_000.0),
)  # fmt: skip
MODELS = {
    "smollm2-135m": SHAPES["smollm2-135m"],
    "gemma3-270m": GEMMA3_270M,
    "qwen3-0.6b": SHAPES["qwen3-0.6b"],
    "llama3-8b": SHAPES["llama3-8b"],
}
CACHE = CacheConfig(max_model_len=4096)  # the engine's defaults otherwise: 32 sequences, 256-token mixed steps
BUCKETS = [pytest.param(True, id="decode"), pytest.param(False, id="mixed")]

# A TPU compile of a step takes 10-60 s of this 2-core machine, so CI compiles every model and both buckets once,
# over both topologies (SmolLM2 as the whole step on one chip, Qwen3 on one chip, Gemma 3 and Llama 3 on the 2x2
# mesh); JAXINFER_AOT_FULL=1 compiles every model on both topologies.
FULL = os.environ.get("JAXINFER_AOT_FULL") == "1"
CI_TPU = {("v6e:1x1", "qwen3-0.6b"), ("v5e:2x2", "gemma3-270m"), ("v5e:2x2", "llama3-8b")}


def _tpu_models(topology: str, models: list[str]) -> list:
    full_only = pytest.mark.skipif(not FULL, reason="full TPU matrix only: JAXINFER_AOT_FULL=1 (CI runs a subset)")
    return [pytest.param(m, marks=() if (topology, m) in CI_TPU else full_only) for m in models]


def _case(model: str, decode_only: bool, hbm_bytes: int, num_devices: int, backend: str = "tpu") -> StepCase:
    full = ModelConfig(**MODELS[model], dtype="bfloat16")
    # One layer of each attention kind the model has (sliding and global for Gemma 3).
    windows = tuple(sorted(set(full.layer_windows), reverse=True))
    cfg = full.replace(num_layers=len(windows), layer_windows=windows)
    return StepCase(cfg, CACHE, decode_only, pool_pages(full, CACHE, hbm_bytes, num_devices, backend))


# ---------------------------------------------------------------------------------------------- TPU


@needs_libtpu
@pytest.mark.parametrize("decode_only", BUCKETS)
@pytest.mark.parametrize("model", _tpu_models("v6e:1x1", list(MODELS)))
def test_tpu_single_chip_compiles_the_kernel(model, decode_only):
    case = _case(model, decode_only, TPU_TOPOLOGIES["v6e:1x1"]["hbm_bytes"], 1)
    hlo = compile_for_tpu(case, "v6e:1x1")
    calls = tpu_kernel_calls(hlo, KERNEL_NAMES[("tpu", decode_only)])
    assert len(calls) == case.cfg.num_layers, f"expected the Pallas kernel in every layer, found {len(calls)}"


# SmolLM2's 9 query heads do not split 4 ways: it runs on one chip (above).
@needs_libtpu
@pytest.mark.parametrize("decode_only", BUCKETS)
@pytest.mark.parametrize("model", _tpu_models("v5e:2x2", ["gemma3-270m", "qwen3-0.6b", "llama3-8b"]))
def test_tpu_2x2_tensor_parallel_compiles_the_kernel(model, decode_only):
    # The engine's mesh (make_mesh(tp=4)) over a v5e 2x2 slice: attention runs per shard under shard_map.
    case = _case(model, decode_only, TPU_TOPOLOGIES["v5e:2x2"]["hbm_bytes"], 4)
    hlo = compile_for_tpu(case, "v5e:2x2", tp=4)
    calls = tpu_kernel_calls(hlo, KERNEL_NAMES[("tpu", decode_only)])
    assert len(calls) == case.cfg.num_layers, f"expected the Pallas kernel in every layer, found {len(calls)}"


@needs_libtpu
@pytest.mark.parametrize("decode_only", BUCKETS)
def test_tpu_whole_paged_step_compiles(decode_only):
    """The engine's whole step (sampler included) for the default model on one chip."""
    case = _case("smollm2-135m", decode_only, TPU_TOPOLOGIES["v5e:1x1"]["hbm_bytes"], 1)
    hlo = compile_for_tpu(case, "v5e:1x1", whole_step=True)
    assert len(tpu_kernel_calls(hlo, KERNEL_NAMES[("tpu", decode_only)])) == case.cfg.num_layers


def _pool_copies(case: StepCase, hlo: str) -> list[str]:
    return copies_of(hlo, math.prod(pool_shape(case.cfg, case.num_pages, case.cc.block_size, backend="tpu")))


@needs_libtpu
@pytest.mark.parametrize("decode_only", BUCKETS)
def test_tpu_step_copies_no_kv_pool(decode_only):
    """The pools are stored as the TPU kernels read them (kernels_pallas.pool_shape: a token's heads in one row,
    padded to 128 lanes), so the step copies no pool: not into a kernel's view, not back for the donated output."""
    case = _case("smollm2-135m", decode_only, TPU_TOPOLOGIES["v5e:1x1"]["hbm_bytes"], 1)
    hlo = compile_for_tpu(case, "v5e:1x1", whole_step=True)  # the compile test_tpu_whole_paged_step_compiles made
    copies = _pool_copies(case, hlo)
    assert not copies, f"{len(copies)} pool-sized copies per step, e.g. {copies[:2]}"


@needs_libtpu
def test_tpu_unpadded_rows_would_copy_the_pools(monkeypatch):
    """Proof that the copy check can fail: SmolLM2's rows unpadded (3 x 64 = 192 lanes) get a default TPU layout
    with the pages axis minor (it pads least), which no kernel reads: each pool is copied in and out every step."""
    monkeypatch.setattr(runner_module.kernels_pallas, "POOL_LANE_MULTIPLE", {})
    case = _case("smollm2-135m", True, TPU_TOPOLOGIES["v5e:1x1"]["hbm_bytes"], 1)
    hlo = compile_for_tpu.__wrapped__(case, "v5e:1x1")  # not the cache: the pools' shape differs under the patch
    cfg = case.cfg
    copies = copies_of(hlo, case.num_pages * case.cc.block_size * cfg.num_kv_heads * cfg.head_dim)
    assert len(copies) >= 2 * cfg.num_layers, copies


@needs_libtpu
@pytest.mark.parametrize("decode_only", BUCKETS)
def test_tpu_step_copies_no_weights(decode_only):
    """SmolLM2's embedding bf16[49152, 576] gets the TPU's least-padded default layout (vocab minor: 576 is not a
    whole number of 128 lanes), where the token lookup's gather copied all 56 MB of it into row-major order every
    step. The lookup is a one-hot matmul there (jaxinfer.model.layers.lookup), which reads it in place."""
    case = _case("smollm2-135m", decode_only, TPU_TOPOLOGIES["v5e:1x1"]["hbm_bytes"], 1)
    hlo = compile_for_tpu(case, "v5e:1x1", whole_step=True)
    copies = [c.strip()[:120] for c in hlo.splitlines() if re.search(r" copy\(%weights_", c)]
    assert not copies, f"{len(copies)} weight copies per step, e.g. {copies[0]}"


@needs_libtpu
def test_tpu_a_gathered_embedding_would_be_copied(monkeypatch):
    """Proof that the weight-copy check can fail: the lookup as a gather copies the embedding every step."""
    monkeypatch.setattr(layers, "TPU_LANES", 576)  # SmolLM2's width now counts as whole rows: the gather runs
    case = _case("smollm2-135m", True, TPU_TOPOLOGIES["v5e:1x1"]["hbm_bytes"], 1)
    hlo = compile_for_tpu.__wrapped__(case, "v5e:1x1")  # not the cache: the patched lookup traces differently
    assert any(re.search(r" copy\(%weights_0_", c) for c in hlo.splitlines())


@needs_libtpu
def test_tpu_oversized_kernel_fails_the_vmem_check(monkeypatch):
    """Proof that the check can fail: with the static VMEM guard lifted, a decode step of 40 f32 pages of 8 KV heads
    x 256 (20 MiB of double-buffered K/V) is rejected by the real compiler against the 16 MiB VMEM limit."""
    monkeypatch.setattr(decode_tpu, "vmem_bytes", lambda *args: 0)
    dev = tpu_devices("v5e:1x1")[0]
    sh = jax.sharding.SingleDeviceSharding(dev)
    av = lambda shape, dt=jnp.float32: jax.ShapeDtypeStruct(shape, dt, sharding=sh)  # noqa: E731
    args = (av((8, 8, 256)), av((1024, 16, 8, 256)), av((1024, 16, 8, 256)), av((8, 40), jnp.int32),
            av((8,), jnp.int32))  # fmt: skip
    fn = functools.partial(decode_tpu.paged_decode_attention, scale=0.1, pages_per_step=40)
    with jax.default_device(dev), pytest.raises(Exception, match="(?i)vmem"):
        jax.jit(fn).lower(*args).compile()


@needs_libtpu
def test_tpu_smem_budget_fits_and_twice_it_does_not(monkeypatch):
    """The static SMEM budget compiles at its limit, and (with the guard lifted) twice the budget is rejected by the
    real compiler for SMEM: the guard's number is the hardware's, halved."""
    dev = tpu_devices("v5e:1x1")[0]
    sh = jax.sharding.SingleDeviceSharding(dev)
    av = lambda shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dt, sharding=sh)  # noqa: E731
    fn = jax.jit(functools.partial(decode_tpu.paged_decode_attention, scale=0.1))
    kv = av((4096, 16, 2, 128))

    def args(rows, width):
        return av((rows, 8, 128)), kv, kv, av((rows, width), jnp.int32), av((rows,), jnp.int32)

    rows = 64
    width = (decode_tpu.SMEM_BUDGET_WORDS - rows) // rows
    decode_tpu.check_supported(*args(rows, width)[:4])  # within the budget
    with jax.default_device(dev):
        fn.lower(*args(rows, width)).compile()
        monkeypatch.setattr(decode_tpu, "SMEM_BUDGET_WORDS", 1 << 40)
        with pytest.raises(Exception, match="(?i)smem"):
            fn.lower(*args(rows, 2 * width + 2)).compile()


# ---------------------------------------------------------------------------------------------- H100


@needs_triton
@pytest.mark.parametrize("decode_only", BUCKETS)
@pytest.mark.parametrize("model", list(MODELS))
def test_h100_kernels_compile_within_limits(model, decode_only):
    case = _case(model, decode_only, H100_HBM_BYTES, 1, "gpu")
    text, kernels = h100_step_kernels(case)
    name = KERNEL_NAMES[("gpu", decode_only)]
    assert name in text and {k.name for k in kernels} == {name}, "expected the Triton kernel, not the reference"
    for kernel in kernels:
        report = compile_for_h100(kernel)
        assert report.shared_bytes <= H100_MAX_SHARED_BYTES, report
        assert report.spill_stores == 0 and report.spill_loads == 0, report


@pytest.mark.parametrize("decode_only", BUCKETS)
@pytest.mark.parametrize("model", list(MODELS))
def test_h100_plain_step_has_no_host_synced_branch(model, decode_only):
    """XLA:GPU copies a conditional's predicate (and a loop's, every iteration) to the host and waits for it there,
    behind the whole forward, before it launches the rest of the step. The step that serves plain requests
    (greedy, temperature, min-p: the sampler's basic variant) lowers for a GPU without one; the advanced variant
    keeps its conditionals, which skip top-k, penalties and logprobs when no row of the step asks for them.
    Lowering only: no GPU compiler needed."""
    case = _case(model, decode_only, H100_HBM_BYTES, 1, "gpu")
    args, _ = step_args(case, [jax.devices("cpu")[0]], 1, "pallas_gpu")
    assert host_synced_control_flow(paged_step.trace(*args).lower(lowering_platforms=("cuda",))) == []
    advanced = args[:8] + (True,) + args[9:]  # (the flat inputs' layout is the basic one; lowering does not mind)
    assert host_synced_control_flow(paged_step.trace(*advanced).lower(lowering_platforms=("cuda",)))


@needs_triton
def test_h100_oversized_kernel_fails_the_shared_memory_check():
    """Proof that the check can fail: 256-token KV blocks of head dim 256 in 4 pipeline stages compile, but need
    more shared memory than an H100 block has."""
    avals = (jax.ShapeDtypeStruct((8, 16, 256), jnp.bfloat16), jax.ShapeDtypeStruct((512, 16, 2, 256), jnp.bfloat16),
             jax.ShapeDtypeStruct((512, 16, 2, 256), jnp.bfloat16), jax.ShapeDtypeStruct((8, 64), jnp.int32),
             jax.ShapeDtypeStruct((8,), jnp.int32))  # fmt: skip
    fn = jax.jit(functools.partial(decode_gpu.paged_decode_attention, scale=0.1, block_kv=256, num_stages=4))
    _, kernels = lower_for_h100(fn, *avals)
    (kernel,) = kernels
    report = compile_for_h100(kernel)
    assert report.shared_bytes > H100_MAX_SHARED_BYTES, report
