"""Paged decode attention for CPU: a numba kernel that the jitted step calls through XLA's FFI.

On XLA:CPU the jnp decode path (kernels_pallas/cpu.py) is bound by XLA's op-level code for small shapes: its
batched [G x D] by [D x keys] dots run at a tenth of the cores' peak and each page gather is a copy (about half of
a batch-32 SmolLM2 decode step; benchmarks/README.md). This kernel walks each row's pages in place: for every key,
all query heads of its KV head read that key once (GQA reuse), the scores of the row go to a scratch row, then one
softmax and one pass over V. Work and memory traffic follow the live tokens, and nothing is copied.

Exact two-pass softmax per row (not an online one: the scores of a row fit in a few hundred KB). Rows are
independent, so a row's result does not depend on the batch it is in. Float32 pools only (the CPU default); other
dtypes take the jnp path.
"""

from __future__ import annotations

import functools
import importlib.util

import jax
import jax.numpy as jnp

from kernels_pallas import numba_ffi
from kernels_pallas.common import UnsupportedCase

TARGET = "jaxinfer_paged_decode_attention_f32"


@functools.cache
def unavailable() -> str | None:
    """Why the kernel cannot run in this process (None: it can, and is registered with XLA). The first call imports
    numba and loads the kernel (about a second; compiled once per machine, about 10 s)."""
    if importlib.util.find_spec("numba") is None:
        return "numba is not installed"
    try:
        from kernels_pallas import decode_cpu_numba
    except (ImportError, ValueError) as e:  # ValueError: numba found no thread-safe threading layer
        return f"the numba kernel did not load ({type(e).__name__}: {e})"
    numba_ffi.register(TARGET, decode_cpu_numba.handler)
    return None


def check_supported(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array | None = None) -> None:
    if jax.default_backend() != "cpu":
        raise UnsupportedCase(f"a CPU kernel (backend is {jax.default_backend()})")
    for name, a in (("q", q), ("k_pages", k_pages), ("v_pages", v_pages)):
        if a.dtype != jnp.float32:
            raise UnsupportedCase(f"{name} is {a.dtype}: float32 only")
    if q.shape[1] % k_pages.shape[2]:
        raise UnsupportedCase(f"{q.shape[1]} query heads are not a multiple of {k_pages.shape[2]} KV heads")
    reason = unavailable()
    if reason is not None:
        raise UnsupportedCase(reason)


def paged_decode_attention(
    q: jax.Array,  # f32[B, Hq, D] one query token per row
    k_pages: jax.Array,  # f32[num_pages, page_size, Hkv, D]
    v_pages: jax.Array,  # f32[num_pages, page_size, Hkv, D]
    page_table: jax.Array,  # i32[B, W]
    lengths: jax.Array,  # i32[B] valid KV tokens incl. the current one (0: no keys, zeros out)
    *,
    scale: float,
    sliding_window: int = 0,
    soft_cap: float | None = None,
) -> jax.Array:  # f32[B, Hq, D]
    reason = unavailable()
    if reason is not None:
        raise UnsupportedCase(reason)
    # Static settings as an operand (the handlers read buffers only); the thread count is numba's at trace time.
    settings = jnp.asarray([scale, sliding_window, soft_cap or 0.0, numba_ffi.num_threads()], jnp.float32)
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(q, k_pages, v_pages, page_table.astype(jnp.int32), lengths.astype(jnp.int32), settings)
