"""Batch-invariant float32 projections of 1-8 rows on CPU: a numba kernel that the jitted step calls through XLA's
FFI (kernels_pallas/project_cpu_numba.py).

XLA:CPU's library dot (YNNPACK) sums each output of x @ W^T (W stored f32[N, K], N a multiple of 16) in one order for
every row count from 2 up, and so does its weight-left form W @ x^T for whole multiples of 16 rows. One row is the
exception: XLA:CPU runs it as a fused loop or Eigen's GEMV, which sum in other orders, and YNNPACK's own form costs
twice as much there; 8 rows in the weight-left form take another of its kernels. This kernel sums 1-8 rows in
YNNPACK's order, so that a sequence's logits are the same alone (one-row decode steps) and batched
(jaxinfer.model.layers.project picks it; benchmarks/README.md has the measurements).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels_pallas import numba_ffi

TARGET = "jaxinfer_project_rows8_f32"
MAX_ROWS = 8  # rows per call (the kernel's vector lanes)


@functools.cache
def unavailable() -> str | None:
    """Why the kernel cannot run in this process (None: it can, and its handler is registered with XLA). The first
    call imports numba and loads the handler from numba's cache, or builds it (once per machine)."""
    reason = numba_ffi.load_failure("kernels_pallas.project_cpu_numba")
    if reason is not None:
        return reason
    from kernels_pallas import project_cpu_numba

    numba_ffi.register(TARGET, project_cpu_numba.handler)
    return None


def supported(x: jax.Array, w: jax.Array) -> bool:
    """Whether `project_rows` runs x f[M, K] times w f[N, K] (or a stack f[L, N, K]): float32, 1-8 rows, on a CPU
    whose kernel loads."""
    rows_ok = x.ndim == 2 and 1 <= x.shape[0] <= MAX_ROWS and w.ndim in (2, 3) and x.shape[1] == w.shape[-1]
    dtypes_ok = x.dtype == jnp.float32 and w.dtype == jnp.float32
    return rows_ok and dtypes_ok and unavailable() is None


def project_rows(x: jax.Array, w: jax.Array, layer: jax.Array | None = None) -> jax.Array:
    """x f32[M, K] (M <= 8) times w f32[N, K] transposed, or times layer `layer` (i32[]) of a stack w f32[L, N, K],
    read in place -> f32[M, N], each output summed in YNNPACK's order."""
    if unavailable() is not None:
        raise RuntimeError(f"the CPU projection kernel cannot run: {unavailable()}")
    rows, n = x.shape[0], w.shape[-2]
    index = jnp.zeros((1,), jnp.int32) if layer is None else jnp.asarray(layer, jnp.int32).reshape(1)
    if rows == 1:  # outputs in lanes: x f32[K] -> f32[N]
        return jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((n,), jnp.float32))(x[0], w, index)[None]
    xt = jnp.pad(x, ((0, MAX_ROWS - rows), (0, 0))).T  # f32[K, 8]: rows in lanes
    out = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((n, MAX_ROWS), jnp.float32))(xt, w, index)
    return out[:, :rows].T
