"""Which accelerator the engine runs on, the dtype `auto` picks there, and the start-up summary.

jax picks its backend by itself and, when a CUDA or TPU plugin is missing or fails, quietly falls back to CPU. An
engine sized and tuned for an accelerator then runs (slowly, with its KV pool sized from host RAM) on the CPU. So a
user who asks for an accelerator -- `--device gpu`, `JAXINFER_DEVICE=tpu`, or `JAX_PLATFORMS=cuda,cpu` -- and gets
the CPU gets an error instead.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import jax

# NOTE: jax is imported inside the functions: the server's argument parser imports this module's constants, and the
# HTTP side starts before jax does.

DEVICE_ENV = "JAXINFER_DEVICE"
DEVICES = ("auto", "cpu", "gpu", "tpu")
DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")

# JAX_PLATFORMS names -> the backend jax reports for them.
_PLATFORM_BACKENDS = {"cuda": "gpu", "rocm": "gpu", "gpu": "gpu", "tpu": "tpu", "cpu": "cpu"}
_INSTALL_HINT = {
    "gpu": 'install jax\'s CUDA wheels: `pip install -e ".[cuda]"` (or `bash scripts/install.sh cuda`)',
    "tpu": 'install jax\'s TPU wheels: `pip install -e ".[tpu]"` (or `bash scripts/install.sh tpu`)',
    "cpu": "set JAX_PLATFORMS=cpu",
}


class DeviceUnavailableError(RuntimeError):
    """The backend the user asked for is not the one jax initialised."""


def requested_device(device: str | None = None) -> str:
    """The backend the user asked for: the argument, else $JAXINFER_DEVICE, else the first entry of $JAX_PLATFORMS
    (jax falls back from `cuda,cpu` to CPU silently), else "auto"."""
    if device is None:
        device = os.environ.get(DEVICE_ENV) or None
    if device is None:
        first = os.environ.get("JAX_PLATFORMS", "").split(",")[0].strip().lower()
        device = _PLATFORM_BACKENDS.get(first, "auto")
    device = device.lower()
    if device not in DEVICES:
        raise ValueError(f"device: expected one of {', '.join(DEVICES)}, got {device!r}")
    return device


def check_device(device: str | None = None) -> str:
    """Returns jax's backend ("cpu", "gpu", "tpu"), or raises DeviceUnavailableError when the requested one differs."""
    import jax

    want = requested_device(device)
    try:
        got = jax.default_backend()
    except (RuntimeError, AssertionError) as e:  # JAX_PLATFORMS=cuda or tpu alone, and no such plugin or device
        platforms = os.environ.get("JAX_PLATFORMS", "")
        hint = _INSTALL_HINT.get(want, "unset JAX_PLATFORMS to run on whatever jax finds")
        detail = str(e).strip() or type(e).__name__
        message = f"device: jax could not start JAX_PLATFORMS={platforms!r} ({detail}); {hint}"
        raise DeviceUnavailableError(message) from None
    if want != "auto" and got != want:
        raise DeviceUnavailableError(
            f"device: {want} was requested but jax initialised {got} ({jax.devices()[0].device_kind}); "
            f"{_INSTALL_HINT[want]}, or pass --device auto to run on whatever jax finds"
        )
    return got


def auto_dtype(backend: str, checkpoint_dtype: str | None) -> str:
    """vLLM's `--dtype auto`: float32 on CPU (XLA:CPU has no fast bf16 matmuls); on GPU/TPU the checkpoint's
    half-precision dtype, else (float32 checkpoints, dequantized GGUF) bfloat16, which tensor cores and the MXU
    take in one pass and which halves the KV cache."""
    if backend == "cpu":
        return "float32"
    if checkpoint_dtype in ("bfloat16", "float16"):
        return checkpoint_dtype
    return "bfloat16"


def resolve_dtype(dtype: str, backend: str, checkpoint_dtype: str | None) -> str:
    if dtype not in DTYPES:
        raise ValueError(f"dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}")
    return auto_dtype(backend, checkpoint_dtype) if dtype == "auto" else dtype


def resolve_kv_cache_dtype(kv_cache_dtype: str | None, model_dtype: str, backend: str | None = None) -> str:
    """The KV pool's dtype: the model's unless set, except on CPU.

    - A float32 model on CPU gets float16 K/V, as llama.cpp's default: the CPU attention kernel reads half the bytes
      and widens them on load (a 128-row decode step of SmolLM2-135M 1.05x, its attention 1.26x, paired; greedy
      tokens equal to transformers' on issue #14's 16 check prompts; benchmarks/README.md), and the pool's byte
      budget holds twice the tokens. `float32` keeps the model's precision in the cache. A seeded request's tokens
      stay the same alone and batched: the step's projections are batch-invariant on CPU (layers.project).
    - A 16-bit model on CPU gets float32 K/V: XLA:CPU writes a step's K/V into a bfloat16 pool by rewriting the
      whole pool (20 ms a step for a 25 MB pool, 10 us in float32; `LLM(dtype="bfloat16")` took 23 s for 12 tokens
      where float32 K/V took 1.6 s), and the kernel takes float32 queries only. A float16 pool it writes in place."""
    if kv_cache_dtype in (None, "auto"):
        if backend == "cpu":
            return "float16" if model_dtype == "float32" else "float32"
        return model_dtype
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype: expected one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    return kv_cache_dtype


def attention_query_dtype(model_dtype: str, kv_dtype: str, backend: str) -> str:
    """The dtype queries attend in: the KV pool's (a --kv-cache-dtype other than the model's), except float32
    queries over a float16 pool on CPU, which the numba kernel reads as they are (it widens the pool's halves on
    load: kernels_pallas/ragged_cpu.py)."""
    if backend == "cpu" and model_dtype == "float32" and kv_dtype == "float16":
        return "float32"
    return kv_dtype


def describe_devices(mesh: jax.sharding.Mesh | None) -> str:
    import jax

    devices = jax.devices()
    kinds = sorted({d.device_kind for d in devices})
    mesh_text = "none (one device)" if mesh is None else ", ".join(f"{k}={v}" for k, v in mesh.shape.items())
    return (
        f"backend {jax.default_backend()} ({', '.join(kinds)}) x{len(devices)} "
        f"({jax.process_count()} process(es)); mesh {mesh_text}"
    )


def describe_attention(
    num_heads: int,  # query heads per model shard
    num_kv_heads: int,  # KV heads per model shard
    head_dim: int,
    dtype: str,  # the KV pool's dtype
    query_dtype: str,  # the queries' (attention_query_dtype)
    num_pages: int,
    page_size: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    impl: str | None,
    pages_per_seq: int,
) -> str:
    """Which attention implementation the decode and the mixed steps will use, and why any kernel declined."""
    import jax

    from kernels_pallas.dispatch import decode_candidates, explain, ragged_candidates

    kv = jax.ShapeDtypeStruct((num_pages, page_size, num_kv_heads, head_dim), dtype)
    parts = []
    for op, cands, tokens in (
        ("decode", decode_candidates(impl), max_num_seqs),
        ("mixed", ragged_candidates(impl), max_num_batched_tokens),
    ):
        q = jax.ShapeDtypeStruct((tokens, num_heads, head_dim), query_dtype)
        table = jax.ShapeDtypeStruct((max_num_seqs, pages_per_seq), "int32")
        name, declined = explain(cands, (q, kv, kv, table))
        why = "".join(f"; {kernel} declined: {reason}" for kernel, reason in declined)
        parts.append(f"{op} {name}{why}")
    return "attention: " + " | ".join(parts)
