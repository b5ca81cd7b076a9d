"""Compile the engine's step for TPU and H100 on a CPU-only machine (see ../shared/AOT_COMPILE.md).

TPU: libtpu's real XLA:TPU + Mosaic compiler, on abstract devices from `jax.experimental.topologies`.
H100: the Triton IR that the Pallas Triton lowering produces, compiled to an sm_90a cubin by the pip `triton`
package (bundled ptxas; no GPU, no CUDA install), with its shared memory, registers and spills read back.

Both toolchains come from the `aot` extra (`bash scripts/install.sh aot` puts them in .venv-aot).
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from unittest import mock

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from jaxinfer.cache.sizing import page_bytes_per_device
from jaxinfer.config import ModelConfig
from jaxinfer.engine.config import CacheConfig
from jaxinfer.engine.runner import _paged_attend, paged_step, pool_shape
from jaxinfer.engine.transfer import from_flat, to_flat
from jaxinfer.model.functional import split_model
from jaxinfer.model.transformer import abstract_model
from jaxinfer.sampling import build_sampling_tensors
from jaxinfer.sharding import KV_POOL_AXES, make_mesh, sharded_config, spec, var_axes
from jaxinfer.step import pack
from kernels_pallas import POOL_LANE_MULTIPLE

# No TPU is attached here: let several processes load libtpu at once (its lockfile otherwise fails the second one, e.g.
# two CI runs on one machine), and skip the cloud metadata queries a TPU VM would answer.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")

# H100 SXM: 227 KiB of shared memory per block (opt-in maximum), 255 registers per thread.
H100_MAX_SHARED_BYTES = 232_448
H100_MAX_REGISTERS = 255

# Topology descriptions libtpu accepts on a CPU host (the name alone is not enough; see AOT_COMPILE.md), with the
# HBM per chip used to size the KV pool the way the engine does.
TPU_TOPOLOGIES = {
    "v5e:1x1": dict(chip_config_name="default", chips_per_host_bounds=(1, 1, 1), hbm_bytes=16 * 2**30),
    "v5e:2x2": dict(chip_config_name="default", chips_per_host_bounds=(2, 2, 1), hbm_bytes=16 * 2**30),
    "v6e:1x1": dict(chip_config_name="default", chips_per_host_bounds=(1, 1, 1), hbm_bytes=32 * 2**30),
    "v6e:2x2": dict(chip_config_name="default", chips_per_host_bounds=(2, 2, 1), hbm_bytes=32 * 2**30),
    "v5p:2x2x1": dict(chip_config_name="megacore", chips_per_host_bounds=(2, 2, 1), hbm_bytes=95 * 2**30),
}
H100_HBM_BYTES = 80 * 2**30

# Names given to pl.pallas_call by each kernel: what must appear in a compiled module.
KERNEL_NAMES = {
    ("tpu", True): "paged_decode_attention_tpu",
    ("tpu", False): "ragged_paged_attention_tpu",
    ("gpu", True): "paged_decode_attention_triton",
    ("gpu", False): "ragged_paged_attention_triton",
}


def have_libtpu() -> bool:
    try:
        import libtpu  # noqa: F401
    except ImportError:
        return False
    return True


def have_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def tpu_devices(topology: str) -> list:
    from jax.experimental import topologies

    opts = dict(TPU_TOPOLOGIES[topology])
    opts.pop("hbm_bytes")
    desc = topologies.get_topology_desc(
        platform="tpu", topology_name=topology, num_slices=1, wrap=(False, False, False), **opts
    )
    return list(desc.devices)


def pool_pages(cfg: ModelConfig, cc: CacheConfig, hbm_bytes: int, num_devices: int, backend: str) -> int:
    """The engine's pool size on a device with this much memory: half of what the weights leave free."""
    weights = sum(int(np.prod(s.shape)) for s in jax.tree.leaves(abstract_model(cfg)[1]))
    weights *= np.dtype(cfg.dtype).itemsize
    free = hbm_bytes * num_devices - weights
    if free <= 0:
        raise ValueError(f"{weights / 2**30:.1f} GiB of weights do not fit {num_devices} x {hbm_bytes / 2**30} GiB")
    itemsize = np.dtype(cc.kv_cache_dtype or cfg.dtype).itemsize
    lanes = POOL_LANE_MULTIPLE.get(backend, 1)  # a TPU pool's rows are padded (kernels_pallas.pool_shape)
    page = page_bytes_per_device(cc.block_size, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, itemsize, 1, lanes)
    return int(free * cc.gpu_memory_utilization) // page


@dataclass(frozen=True)
class StepCase:
    """One compiled step: a model config (with the real per-layer shapes), a cache and a bucket."""

    cfg: ModelConfig
    cc: CacheConfig
    decode_only: bool
    num_pages: int

    @property
    def tokens(self) -> int:
        return self.cc.max_num_seqs if self.decode_only else self.cc.max_num_batched_tokens


def step_args(case: StepCase, devices: list, tp: int, impl: str) -> tuple[tuple, dict]:
    """Abstract arguments of `paged_step` for this case, placed on `devices` (one device, or a tp-way mesh)."""
    cfg, cc = case.cfg, case.cc
    s = cc.max_num_seqs
    inp = pack([], case.tokens, s, cc.pages_per_seq, cc.block_size)
    st = build_sampling_tensors([], s, cc.max_model_len, cc.logit_bias_capacity, False)
    flat, layout = to_flat((inp, st))
    if tp == 1:
        mesh = None
        rep = pool = SingleDeviceSharding(devices[0])
    else:
        mesh = make_mesh(tp, 1, devices=devices)
        cfg = sharded_config(cfg, tp)
        rep, pool = NamedSharding(mesh, P()), NamedSharding(mesh, spec(KV_POOL_AXES, mesh))

    # The family's abstract nnx state, each parameter placed from its logical axes (replicated on one device).
    def place(path, v: nnx.Variable) -> nnx.Variable:
        sh = rep if mesh is None else NamedSharding(mesh, spec(var_axes(v), mesh))
        return v.replace(jax.ShapeDtypeStruct(v.shape, cfg.dtype, sharding=sh))

    state = nnx.map_state(place, abstract_model(cfg)[1])
    model_def, weights = split_model(cfg, state)
    kv_shape = pool_shape(cfg, case.num_pages, cc.block_size, mesh, backend="tpu" if impl == "pallas_tpu" else "gpu")
    kv_dtype = cc.kv_cache_dtype or cfg.dtype
    kv = [(jax.ShapeDtypeStruct(kv_shape, kv_dtype, sharding=pool),) * 2 for _ in range(cfg.num_layers)]
    feed = jax.ShapeDtypeStruct((s,), np.int32, sharding=rep)
    flat = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep) for a in flat)
    args = (
        model_def, weights, cfg, kv, feed, flat, layout, case.decode_only, False, cc.max_logprobs, impl, mesh, False
    )  # fmt: skip
    return args, dict(mesh=mesh, cfg=cfg)


@partial(
    jax.jit, static_argnames=("model_def", "cfg", "layout", "decode_only", "impl", "mesh"), donate_argnames=("kv",)
)
def model_step(model_def, weights, cfg, kv, flat, layout, decode_only: bool, impl: str | None, mesh):
    """`paged_step` up to the logits of the sampled rows: the same packed inputs, the engine's own attention closure
    (K/V writes, the dispatched kernel, shard_map over the model axis), without the sampler. The sampler does not
    depend on the model's shapes and takes most of the step's TPU compile time, so the model matrix compiles this
    and one whole `paged_step` per bucket covers the sampler."""
    inp, _ = from_flat(flat, layout)
    model = model_def.merge(weights)
    hidden, kv = model(inp.token_ids[None], inp.positions[None], kv, _paged_attend(cfg, inp, decode_only, impl, mesh))
    return model.logits(hidden[0][inp.logits_indices]), kv


@functools.lru_cache(maxsize=8)  # a compiled step is checked by more than one test
def compile_for_tpu(case: StepCase, topology: str, tp: int = 1, whole_step: bool = False) -> str:
    """Compiles the model step (or with `whole_step`, the engine's whole `paged_step`) with libtpu; returns the
    optimized HLO text. Compile errors propagate."""
    devices = tpu_devices(topology)[:tp]
    args, _ = step_args(case, devices, tp, "pallas_tpu")
    if not whole_step:
        model_def, weights, cfg, kv, _, flat, layout, decode_only, _, _, impl, mesh, _ = args
        args = (model_def, weights, cfg, kv, flat, layout, decode_only, impl, mesh)
    fn = paged_step if whole_step else model_step
    with jax.default_device(devices[0]):  # Pallas TPU reads the chip generation from the default device
        return fn.lower(*args).compile().as_text()


def copies_of(hlo: str, elements: int) -> list[str]:
    """The copy instructions of a compiled module whose result has `elements` elements (e.g. a whole KV pool)."""
    out = []
    for ln in hlo.splitlines():
        m = re.match(r"\s*%\S+ = \w+\[([\d,]+)\]\S* copy\(", ln)
        if m and int(np.prod([int(n) for n in m.group(1).split(",")])) == elements:
            out.append(ln.strip()[:160])
    return out


def tpu_kernel_calls(hlo: str, kernel: str) -> list[str]:
    """The tpu_custom_call instructions of the compiled module that run `kernel`."""
    return [ln for ln in hlo.splitlines() if 'custom_call_target="tpu_custom_call"' in ln and f"%{kernel}" in ln]


# ---------------------------------------------------------------------------------------------- H100


@dataclass(frozen=True)
class TritonKernel:
    name: str
    ttir: str  # Triton IR text
    num_warps: int
    num_stages: int


@contextmanager
def capture_triton_modules():
    """Records the Triton module of every Pallas Triton kernel lowered inside the block (jaxlib <= 0.10.2 ships it
    to XLA:GPU as IR, so this is the only place it exists as text before XLA compiles it)."""
    from jax._src.pallas.triton import lowering

    captured: list[str] = []
    original = lowering.lower_jaxpr_to_triton_module

    def wrapper(*args, **kwargs):
        result = original(*args, **kwargs)
        captured.append(result.module.operation.get_asm())
        return result

    lowering.lower_jaxpr_to_triton_module = wrapper
    try:
        yield captured
    finally:
        lowering.lower_jaxpr_to_triton_module = original


_CALL_RE = re.compile(r'custom_call_target\s*=\s*"__gpu\$xla\.gpu\.triton"')


def lower_for_h100(fn, *args) -> tuple[str, list[TritonKernel]]:
    """Lowers a jitted function for CUDA; returns the StableHLO text and the Triton kernels in it (deduplicated)."""
    with capture_triton_modules() as modules:
        text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    configs = re.findall(r'name = "(\w+)", num_stages = (\d+) : i32, num_warps = (\d+) : i32', text)
    if len(configs) != len(modules):
        raise AssertionError(f"{len(modules)} Triton modules captured but {len(configs)} Triton custom calls found")
    kernels = {}
    for ttir, (name, stages, warps) in zip(modules, configs, strict=True):
        kernels.setdefault(ttir, TritonKernel(name, ttir, int(warps), int(stages)))
    return text, list(kernels.values())


def h100_step_kernels(case: StepCase) -> tuple[str, list[TritonKernel]]:
    args, _ = step_args(case, [jax.devices("cpu")[0]], 1, "pallas_gpu")
    args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype) if isinstance(a, jax.ShapeDtypeStruct)
                        else a, args)  # fmt: skip
    return lower_for_h100(paged_step, *args)


@dataclass(frozen=True)
class CubinReport:
    name: str
    shared_bytes: int
    registers: int
    spill_stores: int
    spill_loads: int


def compile_for_h100(kernel: TritonKernel) -> CubinReport:
    """Triton IR -> sm_90a cubin with the pip triton (raises on compile errors), then its resources."""
    import triton
    from triton.backends.compiler import GPUTarget

    with tempfile.TemporaryDirectory() as tmp:
        env = {"TRITON_CACHE_DIR": str(Path(tmp) / "cache"), "TRITON_DEFAULT_FP_FUSION": "1"}
        src = Path(tmp) / f"{kernel.name}.ttir"
        src.write_text(kernel.ttir)
        with mock.patch.dict(os.environ, env):
            compiled = triton.compile(
                str(src), target=GPUTarget("cuda", 90, 32),
                options=dict(num_warps=kernel.num_warps, num_stages=kernel.num_stages),
            )  # fmt: skip
        ptx = Path(tmp) / "kernel.ptx"
        ptx.write_text(compiled.asm["ptx"])
        regs, spill_st, spill_ld = _ptxas_resources(ptx)
    return CubinReport(kernel.name, int(compiled.metadata.shared), regs, spill_st, spill_ld)


def _ptxas_resources(ptx: Path) -> tuple[int, int, int]:
    """(registers, spill store bytes, spill load bytes) as the bundled ptxas reports them for sm_90a."""
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(90).path  # the ptxas triton itself picked (the bundled one that reads its PTX version)
    r = subprocess.run([ptxas, "-arch=sm_90a", "-v", str(ptx), "-o", os.devnull], capture_output=True,
                       text=True, check=True)  # fmt: skip
    out = r.stdout + r.stderr
    regs = re.search(r"Used (\d+) registers", out)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out)
    if regs is None or spills is None:
        raise AssertionError(f"unexpected ptxas -v output: {out}")
    return int(regs.group(1)), int(spills.group(1)), int(spills.group(2))
