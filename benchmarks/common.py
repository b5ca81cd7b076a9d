"""Helpers shared by the engine benchmarks (bench_offline, bench_latency, roofline).

Random-weight models at real shapes (`--shape`), so a GPU run needs neither weight files nor a tokenizer, and the
run metadata every JSON carries (device, jax version, date, command line, machine load).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
from flax import nnx

from benchmarks.bench_attention import fill_defaults, format_table, int_list
from jaxinfer.config import ModelConfig, RopeConfig
from jaxinfer.model import abstract_model, init_params
from jaxinfer.model.transformer import Params

__all__ = [
    "fill_defaults",
    "SHAPES", "format_table", "int_list", "metadata", "host_metadata", "random_params", "shape_config", "load_avg",
    "time_calls", "cpu_flags",
]  # fmt: skip

# Real shapes of a few public models (their config.json values; llama3-8b is Llama-3.1-8B, with its llama3 RoPE
# scaling), for random-weight runs. `tiny` is for smoke tests: it compiles in about a second on CPU.
SHAPES: dict[str, dict[str, Any]] = {
    "llama3-8b": dict(
        arch="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
        num_kv_heads=8, head_dim=128, norm_eps=1e-5, max_position_embeddings=131072,
        rope=RopeConfig(theta=500000.0, kind="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                        original_max_position=8192),
    ),
    "qwen3-0.6b": dict(
        arch="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=16,
        num_kv_heads=8, head_dim=128, norm_eps=1e-6, max_position_embeddings=40960, qk_norm=True,
        tie_word_embeddings=True, rope=RopeConfig(theta=1000000.0),
    ),
    "smollm2-135m": dict(
        arch="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
        num_kv_heads=3, head_dim=64, norm_eps=1e-5, max_position_embeddings=8192, tie_word_embeddings=True,
        rope=RopeConfig(theta=100000.0),
    ),
    "tiny": dict(
        arch="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, norm_eps=1e-5, max_position_embeddings=4096, tie_word_embeddings=True,
    ),
}  # fmt: skip

# Above this many parameters the weights are drawn on the device: init_params draws them with numpy on one host
# core, which takes minutes for an 8B model.
_HOST_INIT_MAX_PARAMS = 1_000_000_000


def shape_config(name: str, dtype: str = "bfloat16") -> ModelConfig:
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; expected one of {sorted(SHAPES)}")
    return ModelConfig(**SHAPES[name], dtype=dtype)


def num_params(cfg: ModelConfig) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(abstract_model(cfg)[1])))


def random_params(cfg: ModelConfig, seed: int = 0, std: float = 0.02) -> Params:
    """Random weights at the config's shapes: `jaxinfer.model.init_params`, or the same recipe on the device
    for models over a billion parameters (norms at their identity, everything else normal * std)."""
    if num_params(cfg) <= _HOST_INIT_MAX_PARAMS:
        return init_params(cfg, seed=seed, std=std)
    dtype = jnp.dtype(cfg.dtype)
    keys = iter(jax.random.split(jax.random.key(seed), 4096))

    def make(path: tuple, v: Any) -> Any:
        if path[-2].endswith("norm"):
            return v.replace(jnp.full(v.shape, 1.0 - cfg.norm_offset, dtype))
        return v.replace(_normal(next(keys), tuple(v.shape), dtype, std))

    return nnx.map_state(make, abstract_model(cfg)[1])


@functools.partial(jax.jit, static_argnums=(1, 2))
def _normal(key: jax.Array, shape: tuple[int, ...], dtype: Any, std: float) -> jax.Array:
    # One compile per distinct shape (a handful per model: a fresh lambda per tensor recompiled each of an 8B
    # model's ~290 tensors, 100 s on an H200); drawn in f32 then cast, like init_params.
    return (jax.random.normal(key, shape, jnp.float32) * std).astype(dtype)


def load_avg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def metadata(prog: str, args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    """What the JSON needs to be read later: device, versions, date, command, the resolved flags, machine load."""
    dev = jax.devices()[0]
    return dict(device_kind=dev.device_kind, platform=dev.platform, device_count=jax.device_count(),
                **host_metadata(prog, args, argv))  # fmt: skip


def host_metadata(prog: str, args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    """`metadata` for a process that must not touch a device (a benchmark client whose server owns the
    accelerator: `jax.devices()` would take the GPU's memory): versions, date, host, command, flags, load."""
    return dict(
        jax_version=jax.__version__,
        jaxlib_version=jaxlib.__version__,
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        host=dict(
            cpu_count=os.cpu_count(),
            machine=platform.machine(),
            python=platform.python_version(),
            cpu_model=_cpu_model(),
            cpu_flags=cpu_flags(),
        ),  # fmt: skip
        load_avg_start=load_avg(),
        command=" ".join([f"python -m {prog}", *argv]),
        config={k: v for k, v in vars(args).items() if k != "out"},
    )


def time_calls(fn: Callable[[], Any], warmup: int, iters: int) -> tuple[float, float, list[float]]:
    """(first call s, median s, samples). fn must block until its work is done."""
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return first, statistics.median(samples), samples


def cpu_flags() -> list[str]:
    """The x86 features that decide which kernels the dot libraries pick (a machine class in the figures)."""
    wanted = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_tile")
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), [])
    except OSError:
        return []
    return [w for w in wanted if w in flags]


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def pyplot() -> Any:
    """matplotlib.pyplot on the file-only Agg backend (no display on a benchmark machine), or None if missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt
