"""Backend dispatch for the paged-attention ops.

Each op has an ordered list of candidate implementations per ``impl``; the first whose static support
check passes is used, and the pure-jnp reference is always last. Checks only look at shapes, dtypes and
static options, so the choice is made at trace time and is safe inside ``jax.jit``.

impl:
  None          -> by ``jax.default_backend()``: "gpu" -> "pallas_gpu", "tpu" -> "pallas_tpu", "cpu" -> "cpu",
                   else "reference"
  "cpu"         -> the blocked jnp path for XLA:CPU (kernels_pallas/cpu.py), then reference
  "pallas_gpu"  -> Triton Pallas kernel, then reference
  "pallas_tpu"  -> Mosaic TPU Pallas kernel, then reference
  "interpret"   -> the Pallas kernels in interpret mode (GPU-style first, then TPU-style), then reference
  "interpret_tpu" -> the TPU kernel in interpret mode, then reference
  "reference"   -> pure jnp
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax

from kernels_pallas import cpu, decode_gpu, decode_tpu, ragged_gpu, ragged_tpu, reference
from kernels_pallas.common import UnsupportedCase

_log = logging.getLogger(__name__)

IMPLS = ("pallas_gpu", "pallas_tpu", "interpret", "interpret_tpu", "cpu", "reference")


@dataclass(frozen=True)
class _Candidate:
    name: str
    check: Callable[..., None]  # raises UnsupportedCase
    run: Callable[..., jax.Array]


def _no_check(*args: Any, **kwargs: Any) -> None:
    del args, kwargs


# --- candidates --------------------------------------------------------------------------------------


def gpu_block_kv(head_dim: int) -> int:
    # Keep the K/V register tile (block_kv x head_dim) of the Triton kernels around 8K elements.
    return 64 if head_dim <= 128 else 32


def _decode_gpu(interpret: bool) -> _Candidate:
    def check(q, k_pages, v_pages):
        decode_gpu.check_supported(q, k_pages, v_pages, gpu_block_kv(q.shape[-1]))

    def run(q, k_pages, v_pages, page_table, lengths, **kw):
        block_kv = gpu_block_kv(q.shape[-1])
        return decode_gpu.paged_decode_attention(
            q, k_pages, v_pages, page_table, lengths, block_kv=block_kv, interpret=interpret, **kw
        )

    return _Candidate("pallas_gpu_interpret" if interpret else "pallas_gpu", check, run)


def _decode_tpu(interpret: bool) -> _Candidate:
    def run(q, k_pages, v_pages, page_table, lengths, **kw):
        return decode_tpu.paged_decode_attention(q, k_pages, v_pages, page_table, lengths, interpret=interpret, **kw)

    return _Candidate("pallas_tpu_interpret" if interpret else "pallas_tpu", decode_tpu.check_supported, run)


def _ragged_gpu(interpret: bool) -> _Candidate:
    def check(q, k_pages, v_pages):
        block_q = ragged_gpu.default_block_q(q.shape[1] // max(1, k_pages.shape[2]))
        ragged_gpu.check_supported(q, k_pages, v_pages, block_q, gpu_block_kv(q.shape[-1]))

    def run(q, k_pages, v_pages, *tables, **kw):
        block_kv = gpu_block_kv(q.shape[-1])
        return ragged_gpu.ragged_paged_attention(
            q, k_pages, v_pages, *tables, block_kv=block_kv, interpret=interpret, **kw
        )

    return _Candidate("pallas_gpu_interpret" if interpret else "pallas_gpu", check, run)


def _ragged_tpu(interpret: bool) -> _Candidate:
    def run(q, k_pages, v_pages, *tables, **kw):
        return ragged_tpu.ragged_paged_attention(q, k_pages, v_pages, *tables, interpret=interpret, **kw)

    return _Candidate("pallas_tpu_interpret" if interpret else "pallas_tpu", ragged_tpu.check_supported, run)


_DECODE_CPU = _Candidate("cpu", _no_check, cpu.paged_decode_attention)
_RAGGED_CPU = _Candidate("cpu", _no_check, cpu.ragged_paged_attention)
_DECODE_REF = _Candidate("reference", _no_check, reference.paged_decode_attention)
_RAGGED_REF = _Candidate("reference", _no_check, reference.ragged_paged_attention)


def _resolve_impl(impl: str | None) -> str:
    if impl is None:
        return {"gpu": "pallas_gpu", "tpu": "pallas_tpu", "cpu": "cpu"}.get(jax.default_backend(), "reference")
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}; expected one of {IMPLS} or None")
    return impl


def decode_candidates(impl: str | None = None) -> list[_Candidate]:
    impl = _resolve_impl(impl)
    kernels = {
        "pallas_gpu": [_decode_gpu(False)],
        "pallas_tpu": [_decode_tpu(False)],
        "interpret": [_decode_gpu(True), _decode_tpu(True)],
        "interpret_tpu": [_decode_tpu(True)],
        "cpu": [_DECODE_CPU],
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
        "cpu": [_RAGGED_CPU],
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


def _pick(candidates: list[_Candidate], args: tuple[Any, ...], op: str) -> _Candidate:
    for cand in candidates:
        try:
            cand.check(*args)
        except UnsupportedCase as e:
            _log.debug("%s: %s does not support this case (%s); trying next", op, cand.name, e)
            continue
        return cand
    raise AssertionError("the reference candidate accepts everything")  # pragma: no cover


def decode_implementation(
    q: jax.Array,  # f[B, Hq, D]
    k_pages: jax.Array,  # f[num_pages, page_size, Hkv, D]
    v_pages: jax.Array,  # f[num_pages, page_size, Hkv, D]
    impl: str | None = None,
) -> str:
    """Name of the implementation ``paged_decode_attention`` would use for these shapes."""
    return _pick(decode_candidates(impl), (q, k_pages, v_pages), "decode").name


def ragged_implementation(
    q: jax.Array,  # f[T, Hq, D]
    k_pages: jax.Array,  # f[num_pages, page_size, Hkv, D]
    v_pages: jax.Array,  # f[num_pages, page_size, Hkv, D]
    impl: str | None = None,
) -> str:
    """Name of the implementation ``ragged_paged_attention`` would use for these shapes."""
    return _pick(ragged_candidates(impl), (q, k_pages, v_pages), "ragged").name


def paged_decode_attention(
    q: jax.Array,  # f[B, Hq, D] one query token per sequence
    k_pages: jax.Array,  # f[num_pages, page_size, Hkv, D]
    v_pages: jax.Array,  # f[num_pages, page_size, Hkv, D]
    page_table: jax.Array,  # i32[B, pages_per_seq]
    lengths: jax.Array,  # i32[B] valid KV tokens incl. the current one
    *,
    scale: float,
    sliding_window: int | None = 0,  # None or 0: no window
    soft_cap: float | None = None,  # None or 0: no cap
    impl: str | None = None,
) -> jax.Array:  # f[B, Hq, D]
    cand = _pick(decode_candidates(impl), (q, k_pages, v_pages), "decode")
    return cand.run(q, k_pages, v_pages, page_table, lengths, **_static_opts(scale, sliding_window, soft_cap))


def ragged_paged_attention(
    q: jax.Array,  # f[T, Hq, D] packed query tokens
    k_pages: jax.Array,  # f[num_pages, page_size, Hkv, D]
    v_pages: jax.Array,  # f[num_pages, page_size, Hkv, D]
    page_table: jax.Array,  # i32[max_seqs, pages_per_seq]
    context_lens: jax.Array,  # i32[max_seqs] KV length incl. the new tokens
    query_start_loc: jax.Array,  # i32[max_seqs + 1]
    num_seqs: jax.Array,  # i32[]
    *,
    scale: float,
    sliding_window: int | None = 0,  # None or 0: no window
    soft_cap: float | None = None,  # None or 0: no cap
    impl: str | None = None,
) -> jax.Array:  # f[T, Hq, D]
    cand = _pick(ragged_candidates(impl), (q, k_pages, v_pages), "ragged")
    return cand.run(
        q,
        k_pages,
        v_pages,
        page_table,
        context_lens,
        query_start_loc,
        num_seqs,
        **_static_opts(scale, sliding_window, soft_cap),
    )
