"""Backend dispatch for the paged-attention ops.

Each op has an ordered list of candidate implementations per ``impl``; the first whose static support
check passes is used, and the pure-jnp reference is always last. Checks only look at shapes, dtypes and
static options, so the choice is made at trace time and is safe inside ``jax.jit``.

impl:
  None          -> by ``jax.default_backend()``: "gpu" -> "pallas_gpu", "tpu" -> "pallas_tpu", "cpu" -> "cpu",
                   else "reference"
  "cpu"         -> the numba kernel through XLA's FFI (kernels_pallas/ragged_cpu.py; float32 or float16 pools), then the
                   blocked jnp path for XLA:CPU (kernels_pallas/cpu.py), then reference
  "cpu_jnp"     -> the blocked jnp path alone, then reference (to compare against the kernel)
  "pallas_gpu"  -> Triton Pallas kernel, then reference
  "pallas_tpu"  -> Mosaic TPU Pallas kernel, then reference
  "interpret"   -> the Pallas kernels in interpret mode (GPU-style first, then TPU-style), then reference
  "interpret_tpu" -> the TPU kernel in interpret mode, then reference
  "reference"   -> pure jnp
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from kernels_pallas import cpu, decode_gpu, decode_tpu, numba_ffi, ragged_cpu, ragged_gpu, ragged_tpu, reference
from kernels_pallas.common import UnsupportedCase, heads_shape, heads_view, rows_view

_log = logging.getLogger(__name__)

IMPLS = ("pallas_gpu", "pallas_tpu", "interpret", "interpret_tpu", "cpu", "cpu_jnp", "reference")


@dataclass(frozen=True)
class _Candidate:
    name: str
    check: Callable[..., None]  # raises UnsupportedCase; takes [.., Hkv, D] pools (shapes only)
    run: Callable[..., jax.Array]
    rows: bool = False  # `run` takes pools as stored, f[P, page_size, W] (common.pool_shape), and num_kv_heads


def _no_check(*args: Any, **kwargs: Any) -> None:
    del args, kwargs


# --- candidates --------------------------------------------------------------------------------------


def gpu_block_kv(head_dim: int) -> int:
    # Keep the K/V register tile (block_kv x head_dim) of the Triton kernels around 8K elements.
    return 64 if head_dim <= 128 else 32


def gpu_ragged_warps(head_dim: int) -> int:
    # The ragged kernel's f32 accumulator is (block_q * G_pad) x head_dim = 64 x D: at D = 256 four warps need more
    # than 255 registers a thread and spill (ptxas, sm_90a; tests/aot); eight fit in 217.
    return 8 if head_dim >= 256 else 4


def _decode_gpu(interpret: bool) -> _Candidate:
    def check(q, k_pages, v_pages, page_table=None):
        decode_gpu.check_supported(q, k_pages, v_pages, gpu_block_kv(q.shape[-1]))

    def run(q, k_pages, v_pages, page_table, lengths, **kw):
        block_kv = gpu_block_kv(q.shape[-1])
        return decode_gpu.paged_decode_attention(
            q, k_pages, v_pages, page_table, lengths, block_kv=block_kv, interpret=interpret, **kw
        )

    return _Candidate("pallas_gpu_interpret" if interpret else "pallas_gpu", check, run)


def _decode_tpu(interpret: bool) -> _Candidate:
    def run(q, k_rows, v_rows, page_table, lengths, **kw):
        return decode_tpu.paged_decode_attention_rows(q, k_rows, v_rows, page_table, lengths, interpret=interpret, **kw)

    return _Candidate("pallas_tpu_interpret" if interpret else "pallas_tpu", decode_tpu.check_supported, run, True)


def _ragged_gpu(interpret: bool) -> _Candidate:
    def check(q, k_pages, v_pages, page_table=None):
        block_q = ragged_gpu.default_block_q(q.shape[1] // max(1, k_pages.shape[2]))
        ragged_gpu.check_supported(q, k_pages, v_pages, block_q, gpu_block_kv(q.shape[-1]))

    def run(q, k_pages, v_pages, *tables, **kw):
        head_dim = q.shape[-1]
        return ragged_gpu.ragged_paged_attention(
            q, k_pages, v_pages, *tables, block_kv=gpu_block_kv(head_dim), num_warps=gpu_ragged_warps(head_dim),
            interpret=interpret, **kw,
        )  # fmt: skip

    return _Candidate("pallas_gpu_interpret" if interpret else "pallas_gpu", check, run)


def _ragged_tpu(interpret: bool) -> _Candidate:
    def run(q, k_rows, v_rows, *tables, **kw):
        return ragged_tpu.ragged_paged_attention_rows(q, k_rows, v_rows, *tables, interpret=interpret, **kw)

    return _Candidate("pallas_tpu_interpret" if interpret else "pallas_tpu", ragged_tpu.check_supported, run, True)


_DECODE_CPU_NUMBA = _Candidate("cpu_numba", ragged_cpu.check_supported, ragged_cpu.paged_decode_attention)
_RAGGED_CPU_NUMBA = _Candidate("cpu_numba", ragged_cpu.check_supported, ragged_cpu.ragged_paged_attention)
_DECODE_CPU_JNP = _Candidate("cpu_jnp", _no_check, cpu.paged_decode_attention)
_RAGGED_CPU_JNP = _Candidate("cpu_jnp", _no_check, cpu.ragged_paged_attention)
_DECODE_REF = _Candidate("reference", _no_check, reference.paged_decode_attention)
_RAGGED_REF = _Candidate("reference", _no_check, reference.ragged_paged_attention)


def _resolve_impl(impl: str | None) -> str:
    if impl is None:
        return {"gpu": "pallas_gpu", "tpu": "pallas_tpu", "cpu": "cpu"}.get(jax.default_backend(), "reference")
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}; expected one of {IMPLS} or None")
    return impl


def prepare(impl: str | None, model_shape: Callable[[], tuple[int, Any, Any]]) -> bool:
    """Starts, ahead of the first trace, what the kernel `impl` resolves to needs: on the CPU backend with float32
    weights and float32 or float16 pools, the numba kernel's build (`ragged_cpu.prebuild`), in a child process while
    the caller loads the weights. `model_shape()` gives (head dim, dtype, KV dtype); it is called only where a kernel
    could build ahead, so other backends read no config. True when something started. Decides nothing: the first
    trace picks the kernel as ever, and finds its build done or registers a forwarder to it (`finish_builds`)."""
    if jax.default_backend() != "cpu" or _resolve_impl(impl) != "cpu":
        return False
    head_dim, dtype, kv_dtype = model_shape()
    if jnp.dtype(dtype) == jnp.float32 and jnp.dtype(kv_dtype).name in ragged_cpu.POOL_DTYPES:
        return ragged_cpu.prebuild(head_dim, jnp.dtype(kv_dtype).name)
    return False


def finish_builds() -> None:
    """Loads the kernels that a trace registered while their builds (`prepare`) were still running, waiting for
    those builds; after it every compiled step runs at once (else the first one to call such a kernel waits for
    it). Raises `numba_ffi.BuildFailed` for a build that fails in it (one that failed before is left to the kernel's
    fallback). Nothing to do, and cheap, in every other case."""
    numba_ffi.finish_builds()


def decode_candidates(impl: str | None = None) -> list[_Candidate]:
    impl = _resolve_impl(impl)
    kernels = {
        "pallas_gpu": [_decode_gpu(False)],
        "pallas_tpu": [_decode_tpu(False)],
        "interpret": [_decode_gpu(True), _decode_tpu(True)],
        "interpret_tpu": [_decode_tpu(True)],
        "cpu": [_DECODE_CPU_NUMBA, _DECODE_CPU_JNP],
        "cpu_jnp": [_DECODE_CPU_JNP],
        "reference": [],
    }[impl]
    return [*kernels, _DECODE_REF]


def ragged_candidates(impl: str | None = None) -> list[_Candidate]:
    impl = _resolve_impl(impl)
    kernels = {
        "pallas_gpu": [_ragged_gpu(False)],
        "pallas_tpu": [_ragged_tpu(False)],
        "interpret": [_ragged_gpu(True), _ragged_tpu(True)],
        "interpret_tpu": [_ragged_tpu(True)],
        "cpu": [_RAGGED_CPU_NUMBA, _RAGGED_CPU_JNP],
        "cpu_jnp": [_RAGGED_CPU_JNP],
        "reference": [],
    }[impl]
    return [*kernels, _RAGGED_REF]


def _static_opts(scale: float, sliding_window: int | None, soft_cap: float | None) -> dict[str, Any]:
    # Callers pass model-config values straight through: None/0 both mean "off", and numpy scalars must
    # become plain Python numbers to serve as hashable jit static arguments.
    return dict(
        scale=float(scale),
        sliding_window=int(sliding_window or 0),
        soft_cap=float(soft_cap) if soft_cap else None,
    )


# (op, kernel, reason) triples already warned about: a fallback is worth one warning per process, not one per trace.
_warned: set[tuple[str, str, str]] = set()
_warned_lock = threading.Lock()


def _warn_fallback(op: str, kernel: str, reason: str) -> None:
    key = (op, kernel, reason)
    with _warned_lock:
        if key in _warned:
            return
        _warned.add(key)
    _log.warning("%s attention: %s declined this case (%s); falling back to the next implementation", op, kernel,
                 reason)  # fmt: skip


def explain(candidates: list[_Candidate], args: tuple[Any, ...]) -> tuple[str, list[tuple[str, str]]]:
    """(chosen implementation, [(kernel, why it declined)] for every kernel tried before it). No warnings."""
    declined = []
    for cand in candidates:
        try:
            cand.check(*args)
        except UnsupportedCase as e:
            declined.append((cand.name, str(e)))
            continue
        return cand.name, declined
    raise AssertionError("the reference candidate accepts everything")  # pragma: no cover


def _pick(candidates: list[_Candidate], args: tuple[Any, ...], op: str) -> _Candidate:
    name, declined = explain(candidates, args)
    for kernel, reason in declined:
        _warn_fallback(op, kernel, reason)
    return next(c for c in candidates if c.name == name)


def decode_implementation(
    q: jax.Array,  # f[B, Hq, D]
    k_pages: jax.Array,  # f[num_pages, page_size, Hkv, D]
    v_pages: jax.Array,  # f[num_pages, page_size, Hkv, D]
    impl: str | None = None,
    page_table: jax.Array | None = None,  # i32[B, pages_per_seq]; None: skip the checks that need its size
) -> str:
    """Name of the implementation ``paged_decode_attention`` would use for these shapes (no warning)."""
    return explain(decode_candidates(impl), (q, k_pages, v_pages, page_table))[0]


def ragged_implementation(
    q: jax.Array,  # f[T, Hq, D]
    k_pages: jax.Array,  # f[num_pages, page_size, Hkv, D]
    v_pages: jax.Array,  # f[num_pages, page_size, Hkv, D]
    impl: str | None = None,
    page_table: jax.Array | None = None,  # i32[max_seqs, pages_per_seq]; None: skip the checks that need its size
) -> str:
    """Name of the implementation ``ragged_paged_attention`` would use for these shapes (no warning)."""
    return explain(ragged_candidates(impl), (q, k_pages, v_pages, page_table))[0]


def _heads_shape(q: jax.Array, k_pages: jax.Array, num_kv_heads: int | None) -> jax.ShapeDtypeStruct:
    """The [.., Hkv, D] shape the checks see, for pools given either way."""
    if k_pages.ndim == 4:
        return jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype)
    if num_kv_heads is None:
        raise ValueError("pools given as stored rows f[P, page_size, W] need num_kv_heads")
    return heads_shape(k_pages, num_kv_heads, q.shape[-1])


def _run(cand: _Candidate, q, k_pages, v_pages, heads: jax.ShapeDtypeStruct, *tables, **kw) -> jax.Array:
    """Runs `cand` on the pools in the form it takes: a free reshape between the forms, unless the stored rows are
    padded and the kernel reads only [.., Hkv, D] (a fallback from a TPU kernel: the slice costs a copy)."""
    num_kv_heads, head_dim = heads.shape[2:]
    if cand.rows:
        if k_pages.ndim == 4:
            k_pages, v_pages = rows_view(k_pages), rows_view(v_pages)
        return cand.run(q, k_pages, v_pages, *tables, num_kv_heads=num_kv_heads, **kw)
    if k_pages.ndim == 3:
        k_pages, v_pages = heads_view(k_pages, num_kv_heads, head_dim), heads_view(v_pages, num_kv_heads, head_dim)
    return cand.run(q, k_pages, v_pages, *tables, **kw)


def paged_decode_attention(
    q: jax.Array,  # f[B, Hq, D] one query token per sequence
    k_pages: jax.Array,  # f[num_pages, page_size, Hkv, D], or as stored: f[num_pages, page_size, W] (pool_shape)
    v_pages: jax.Array,  # the same shape as k_pages
    page_table: jax.Array,  # i32[B, pages_per_seq]
    lengths: jax.Array,  # i32[B] valid KV tokens incl. the current one
    *,
    scale: float,
    sliding_window: int | None = 0,  # None or 0: no window
    soft_cap: float | None = None,  # None or 0: no cap
    impl: str | None = None,
    num_kv_heads: int | None = None,  # Hkv of pools given as stored rows
) -> jax.Array:  # f[B, Hq, D]
    heads = _heads_shape(q, k_pages, num_kv_heads)
    cand = _pick(decode_candidates(impl), (q, heads, heads, page_table), "decode")
    return _run(cand, q, k_pages, v_pages, heads, page_table, lengths, **_static_opts(scale, sliding_window, soft_cap))


def ragged_paged_attention(
    q: jax.Array,  # f[T, Hq, D] packed query tokens
    k_pages: jax.Array,  # f[num_pages, page_size, Hkv, D], or as stored: f[num_pages, page_size, W] (pool_shape)
    v_pages: jax.Array,  # the same shape as k_pages
    page_table: jax.Array,  # i32[max_seqs, pages_per_seq]
    context_lens: jax.Array,  # i32[max_seqs] KV length incl. the new tokens
    query_start_loc: jax.Array,  # i32[max_seqs + 1]
    num_seqs: jax.Array,  # i32[]
    *,
    scale: float,
    sliding_window: int | None = 0,  # None or 0: no window
    soft_cap: float | None = None,  # None or 0: no cap
    impl: str | None = None,
    num_kv_heads: int | None = None,  # Hkv of pools given as stored rows
) -> jax.Array:  # f[T, Hq, D]
    heads = _heads_shape(q, k_pages, num_kv_heads)
    cand = _pick(ragged_candidates(impl), (q, heads, heads, page_table), "ragged")
    return _run(
        cand, q, k_pages, v_pages, heads, page_table, context_lens, query_start_loc, num_seqs,
        **_static_opts(scale, sliding_window, soft_cap),
    )  # fmt: skip
