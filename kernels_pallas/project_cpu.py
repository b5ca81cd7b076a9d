"""Batch-invariant float32 projections on CPU, one row or many (in chunks of 8 rows, or 32 where numba compiles for
AVX-512): a numba kernel that the jitted step calls through XLA's FFI (kernels_pallas/project_cpu_numba.py).

XLA:CPU's library dot (YNNPACK) sums each output of x @ W^T (W stored f32[N, K], N a multiple of 16) in one order for
every row count from 2 up, and so does its weight-left form W @ x^T for whole multiples of 16 rows. One row is the
exception: XLA:CPU runs it as a fused loop or Eigen's GEMV, which sum in other orders, and YNNPACK's own form costs
twice as much there; 8 rows in the weight-left form take another of its kernels. This kernel sums its rows in
YNNPACK's order, so that a sequence's logits are the same alone (one-row decode steps) and batched, at the pace the
weights stream from memory (jaxinfer.model.layers.project picks it; benchmarks/README.md has the measurements).
"""

from __future__ import annotations

import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import numba_ffi

TARGET = "jaxinfer_project_rows_f32"
# Two rows and more go in the lanes of a vector of one of these widths, the rows padded to it.
ROW_LANES = (8, 16, 32)


@functools.cache
def max_rows() -> int:
    """The most rows the kernel takes on this CPU: 32 where numba compiles for AVX-512 (eight outputs' chains of 32
    rows fill 16 of its 32 registers), else 8 (AVX2's 16 registers hold eight chains of one 8-lane vector)."""
    return ROW_LANES[-1] if numba_ffi.compiles_for_avx512() else ROW_LANES[0]


def applies(dtype) -> bool:
    """Whether the steps of a model in `dtype` may call the kernel: float32 on the CPU backend."""
    return jax.default_backend() == "cpu" and jnp.dtype(dtype) == jnp.float32


def unavailable() -> str | None:
    """Why the kernel cannot run in this process (None: it can, and its handler is registered with XLA). The first
    call imports numba and loads the handler from numba's cache, or builds it (once per machine: ~11 s on 2 cores);
    a call while `prepare`'s thread does that waits for it."""
    with _loading:
        return _unavailable()


_loading = threading.Lock()


def prepare() -> None:
    """Starts `unavailable`'s load (or build) on a thread, so that it overlaps the caller's loading of the weights:
    on a new machine the build ran in series with it, before the steps could compile. numba compiles its IR with
    LLVM outside the GIL."""
    threading.Thread(target=unavailable, name="project-kernel-load", daemon=True).start()


@functools.cache
def _unavailable() -> str | None:
    reason = numba_ffi.load_failure("kernels_pallas.project_cpu_numba")
    if reason is not None:
        return reason
    from kernels_pallas import project_cpu_numba

    numba_ffi.register(TARGET, project_cpu_numba.handler)
    return None


def supported(x: jax.Array, w: jax.Array) -> bool:
    """Whether `project_rows` runs x f[M, K] times w f[N, K] (or a stack f[L, N, K]): float32, one row or more, on
    a CPU whose kernel loads and whose library dot sums N outputs in an order the kernel has (`library_k_block`)."""
    rows_ok = x.ndim == 2 and x.shape[0] >= 1 and w.ndim in (2, 3) and x.shape[1] == w.shape[-1]
    dtypes_ok = x.dtype == jnp.float32 and w.dtype == jnp.float32
    return rows_ok and dtypes_ok and unavailable() is None and library_k_block(w.shape[-2]) is not None


# The library's blocks of inputs seen so far: 2048 on the AVX2 EPYC; 512 on a 2-core AVX-512 EPYC (znver4) for
# output counts that are multiples of 64. That one sums other counts (16, 32, 48 outputs) in two or four chains over
# alternate inputs, which the kernel does not have.
K_BLOCKS = (2048, 512)
# (outputs, inputs) the order is probed at, for output counts that are multiples of 64 and for the other multiples
# of 16: SmolLM2's square projection (or 48 outputs of it), and a kernel whose inputs span two blocks of 2048 and end
# inside a third.
PROBE_SHAPES = {True: ((576, 576), (64, 4100)), False: ((48, 576), (16, 4100))}


def library_k_block(n: int) -> int | None:
    """The block of inputs (`K_BLOCKS`) with which the kernel sums n outputs as this machine's library dot does, bit
    for bit; None where none does (the caller then takes the library's dot itself)."""
    return _library_k_block(n % 64 == 0)


def library_dot(x: jax.Array, w: jax.Array) -> jax.Array:
    """x f32[M, K] @ w f32[N, K]^T as XLA's library dot, contracted on both minor axes (the engine's layout)."""
    return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())))


def same_bits(a: jax.Array, b: jax.Array) -> jax.Array:
    """bool[]: whether float32 a and b hold the same bits everywhere (-0.0 is not 0.0 here)."""
    return jnp.all(jax.lax.bitcast_convert_type(a, jnp.int32) == jax.lax.bitcast_convert_type(b, jnp.int32))


def run_probe(fn, *args) -> np.ndarray:
    """Runs the jitted check `fn` on this process's own CPU device, eagerly even inside a trace, as numpy. Under
    jax.distributed, jax.devices("cpu")[0] is another process's: the second process hung there."""
    with jax.ensure_compile_time_eval(), jax.default_device(jax.local_devices(backend="cpu")[0]):
        return np.asarray(jax.jit(fn)(*args))


@functools.cache
def _library_k_block(wide: bool) -> int | None:
    """Probes the kernel against the library dot at `PROBE_SHAPES[wide]` for one row, five and `max_rows()` (each
    of the kernel's forms this CPU uses), once per process, in one compiled program; on CPU."""
    if unavailable() is not None:
        return None
    rng = np.random.default_rng(0)
    cases = [(rng.standard_normal((max_rows(), k), dtype=np.float32), rng.standard_normal((n, k), dtype=np.float32))
             for n, k in PROBE_SHAPES[wide]]  # fmt: skip

    def same(cases: list) -> jax.Array:  # bool[block]: the kernel's bits are the library's at every case and row
        return jnp.stack([
            jnp.all(jnp.stack([same_bits(project_rows(x[:rows], w, k_block=k_block), library_dot(x, w)[:rows])
                               for x, w in cases for rows in sorted({1, 5, max_rows()})]))
            for k_block in K_BLOCKS
        ])  # fmt: skip

    matches = run_probe(same, cases)
    return next((b for b, ok in zip(K_BLOCKS, matches, strict=True) if ok), None)


def row_layout(rows: int) -> tuple[int, int]:
    """How the kernel takes 2 rows and more: (lanes, padded). Whole chunks of `lanes` rows (the widest vector this
    CPU's kernel has, or the narrowest that holds them all), then the rest in one chunk of the narrowest width that
    holds it; `padded` rows in all, the padding rows zero."""
    widths = [lanes for lanes in ROW_LANES if lanes <= max_rows()]
    lanes = next((lanes for lanes in widths if lanes >= rows), widths[-1])
    rest = rows % lanes
    return lanes, rows - rest + (next(w for w in widths if w >= rest) if rest else 0)


def project_rows(x: jax.Array, w: jax.Array, layer: jax.Array | None = None, k_block: int | None = None) -> jax.Array:
    """x f32[M, K] times w f32[N, K] transposed, or times layer `layer` (i32[]) of a stack w f32[L, N, K], read in
    place -> f32[M, N], each output one chain of FMAs over each block of `k_block` inputs (None: the library's,
    `library_k_block`), the blocks' sums added in order. Rows in chunks (`row_layout`), one call."""
    if unavailable() is not None:
        raise RuntimeError(f"the CPU projection kernel cannot run: {unavailable()}")
    rows, n = x.shape[0], w.shape[-2]
    k_block = k_block or library_k_block(n) or K_BLOCKS[0]
    lanes, padded = row_layout(rows)
    index = jnp.stack([jnp.zeros((), jnp.int32) if layer is None else jnp.asarray(layer, jnp.int32),
                       jnp.int32(k_block), jnp.int32(lanes)])  # fmt: skip
    if rows == 1:  # outputs in lanes: x f32[K] -> f32[N]
        return jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((n,), jnp.float32))(x[0], w, index)[None]
    xt = jnp.pad(x, ((0, padded - rows), (0, 0))).T  # f32[K, padded]: rows in columns, the kernel's vector lanes
    return jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((rows, n), jnp.float32))(xt, w, index)
