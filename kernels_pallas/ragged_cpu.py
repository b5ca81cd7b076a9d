"""Paged attention for CPU: a numba kernel that the jitted step calls through XLA's FFI.

On XLA:CPU the jnp path (kernels_pallas/cpu.py) is bound by XLA's op-level code for small shapes: its batched
[rows x D] by [D x keys] dots run at a tenth of the cores' peak and each page gather is a copy (decode attention
was about half of a batch-32 SmolLM2 decode step; benchmarks/README.md). This kernel walks each sequence's pages in
place. A decode token (or a prefill chunk's last token alone) is one work item with all its KV heads: one pass
over its pages in order, each page's K rows then its V rows (those of consecutive heads are one contiguous block),
under an online softmax (running max and sum per row); a whole page's P.V is a loop over the head dim with the
page's keys unrolled inside. With fewer decodes than two per thread, a decode's KV heads are items of their own.
A prefill block of up to `BLOCK_Q` query tokens is an item per KV head: its query rows (tokens x the KV head's
query heads) go over the keys four at a time, so a key loaded once feeds four dot products, then each row's exact
two-pass softmax over its own keys (causal, sliding window, soft-cap; the scores fit in a few MB) and one pass
over V. Work and memory traffic follow the live tokens, and nothing is copied.

Items are independent and a row's arithmetic does not depend on which item or thread computes it, so a
sequence's result does not depend on the batch it is in. Float32 queries over float32 or float16 pools (the latter
read as halves and widened on load: half the bytes); other dtypes take the jnp path.
Same contracts as `kernels_pallas.reference` (table entries past a row's keys are never read, padding tokens and
rows with no keys give zeros).
"""

from __future__ import annotations

import logging
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from kernels_pallas import numba_ffi
from kernels_pallas.common import UnsupportedCase

POOL_DTYPES = ("float32", "float16")  # the pools the kernel reads (ragged_cpu_numba's handlers)

_log = logging.getLogger(__name__)

# The FFI targets' names start with this; each handler variant (ragged_cpu_numba.variant) has its own target.
TARGET = "jaxinfer_ragged_paged_attention_f32"
# How long the process waits for a background build (`prebuild`) before building the handler itself. A build takes
# about 10 s on 2 cores.
PREBUILD_TIMEOUT_S = 300.0


def _key(head_dim: int, kv_dtype: str) -> tuple[int, str]:
    """The handler that runs this head dim over this pool dtype: (ragged_cpu_numba.variant, dtype)."""
    from kernels_pallas import ragged_cpu_numba

    return ragged_cpu_numba.variant(head_dim), jnp.dtype(kv_dtype).name


def target(head_dim: int, kv_dtype: str = "float32") -> str:
    """The FFI target that runs this head dim over this pool dtype: `TARGET_d64` for a specialized head dim,
    `TARGET_any` for the others; `_f16` after either for float16 pools."""
    variant, dtype = _key(head_dim, kv_dtype)
    return (f"{TARGET}_d{variant}" if variant else f"{TARGET}_any") + ("_f16" if dtype == "float16" else "")


def unavailable(head_dim: int, kv_dtype: str = "float32") -> str | None:
    """Why the kernel cannot run this head dim in this process (None: it can, and its handler, or a forwarder to the
    handler being built, is registered with XLA). The first call imports numba (about half a second); the first for
    a handler variant loads the handler from numba's cache (a fraction of a second) or builds it (about 10 s on 2
    cores, once per machine), or, while a child `prebuild` started is building it, registers a forwarder to it and
    returns at once. A handler whose build failed beside a trace is unavailable from then on."""
    reason = _numba_missing()
    if reason is not None:
        return reason
    error = numba_ffi.failed(target(head_dim, kv_dtype))
    if error is not None:  # built beside a trace, and the build failed: later traces take another kernel
        return f"the numba kernel failed to build ({type(error).__name__}: {error})"
    from kernels_pallas import ragged_cpu_numba

    key = _key(head_dim, kv_dtype)

    def build():
        _join_prebuild(key)
        return ragged_cpu_numba.handler(head_dim, key[1])

    # While a child still builds the handler, a forwarder is registered instead: the trace and XLA's compiles go on
    # beside the build (on a new machine, 6 s of the build were left when the first trace came), and the handler is
    # loaded once built (numba_ffi.finish_builds, after the engine's warm-up, or the first step that runs it).
    numba_ffi.register(target(head_dim, kv_dtype), build, building=_building(key))
    return None


# handler (`_key`) -> the child process building it, and the file its stderr goes to
_prebuilds: dict[tuple[int, str], tuple[subprocess.Popen, Any]] = {}
_prebuild_lock = threading.Lock()


def prebuild(head_dim: int, kv_dtype: str = "float32") -> bool:
    """Starts building head_dim's handler in a child process when this machine has not built it yet (numba's cache
    lacks it), so that it builds while the caller loads the model's weights and compiles its steps: on a new machine
    the kernel's build was 9-10 s of a 25 s start, in series with both. A trace meanwhile registers a forwarder to
    the handler (`unavailable`); the handler is loaded from the cache, in a fraction of a second, once the child is
    done (`numba_ffi.finish_builds`, or the first run that calls it). True when a child started;
    False when there is nothing to do (numba is missing, the handler is registered, cached or being built)."""
    if _numba_missing() is not None or numba_ffi.registered(target(head_dim, kv_dtype)):
        return False
    from kernels_pallas import ragged_cpu_numba

    key = _key(head_dim, kv_dtype)
    with _prebuild_lock:
        if key in _prebuilds or ragged_cpu_numba.cached(head_dim, key[1]):
            return False
        errors = tempfile.TemporaryFile()  # a file, not a pipe: a child nobody joins can never block on it
        try:
            child = subprocess.Popen(_child_command(head_dim, key[1]), stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=errors)  # fmt: skip
        except OSError as e:  # no process can be started here: the first trace builds it, as without a child
            errors.close()
            _log.warning("could not start the CPU attention kernel's background build (%s)", e)
            return False
        _prebuilds[key] = (child, errors)
    return True


# The child imports this package from where this process found it (its sys.path may lack that folder: a notebook's
# own sys.path, a script run from elsewhere).
_CHILD = """
import importlib.util, os, sys
root = sys.argv[2]
spec = importlib.util.find_spec("kernels_pallas")
if spec is None or os.path.dirname(os.path.dirname(os.path.realpath(spec.origin))) != root:
    sys.path.insert(0, root)
from kernels_pallas.ragged_cpu_numba import handler
handler(int(sys.argv[1]), sys.argv[3])
"""


def _child_command(head_dim: int, kv_dtype: str) -> list[str]:
    return [sys.executable, "-c", _CHILD, str(head_dim), str(Path(__file__).resolve().parent.parent), kv_dtype]


def _building(key: tuple[int, str]) -> bool:
    """Whether a child is building this handler (`_key`) now."""
    with _prebuild_lock:
        started = _prebuilds.get(key)
    return started is not None and started[0].poll() is None


def _join_prebuild(key: tuple[int, str]) -> None:
    """Waits for the child building this handler (`_key`), if one was started. Whatever became of it, the caller then
    gets the handler from numba's cache or builds it itself; a failed child is logged with its error."""
    with _prebuild_lock:
        started = _prebuilds.pop(key, None)
    if started is None:
        return
    child, errors = started
    with errors:
        try:
            child.wait(timeout=PREBUILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            _log.warning("the CPU attention kernel's background build passed %.0f s; building it here",
                         PREBUILD_TIMEOUT_S)  # fmt: skip
            return
        if child.returncode != 0:
            errors.seek(0)
            tail = errors.read().decode(errors="replace").strip().splitlines()[-5:]
            _log.warning("the CPU attention kernel's background build failed (exit %d); building it here: %s",
                         child.returncode, " | ".join(tail))  # fmt: skip


def _numba_missing() -> str | None:
    return numba_ffi.load_failure("kernels_pallas.ragged_cpu_numba")


def check_supported(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array | None = None) -> None:
    if jax.default_backend() != "cpu":
        raise UnsupportedCase(f"a CPU kernel (backend is {jax.default_backend()})")
    if q.dtype != jnp.float32:
        raise UnsupportedCase(f"q is {q.dtype}: float32 only")
    for name, a in (("k_pages", k_pages), ("v_pages", v_pages)):
        if a.dtype.name not in POOL_DTYPES or a.dtype != k_pages.dtype:
            raise UnsupportedCase(f"{name} is {a.dtype}: float32 or float16 pools of one dtype only")
    if q.shape[1] % k_pages.shape[2]:
        raise UnsupportedCase(f"{q.shape[1]} query heads are not a multiple of {k_pages.shape[2]} KV heads")
    reason = unavailable(q.shape[-1], k_pages.dtype.name)
    if reason is not None:
        raise UnsupportedCase(reason)


def ragged_paged_attention(
    q: jax.Array,  # f32[T, Hq, D] query tokens of all sequences, packed
    k_pages: jax.Array,  # f32 or f16 [num_pages, page_size, Hkv, D] (new tokens' K/V already written)
    v_pages: jax.Array,  # k_pages' shape and dtype
    page_table: jax.Array,  # i32[max_seqs, W]
    context_lens: jax.Array,  # i32[max_seqs] KV length incl. the new query tokens
    query_start_loc: jax.Array,  # i32[max_seqs + 1]
    num_seqs: jax.Array,  # i32[] (or i32[1])
    *,
    scale: float,
    sliding_window: int = 0,
    soft_cap: float | None = None,
) -> jax.Array:  # f32[T, Hq, D], zeros for padding tokens
    reason = unavailable(q.shape[-1], k_pages.dtype.name)
    if reason is not None:
        raise UnsupportedCase(reason)
    # Static settings as an operand (the handlers read buffers only); the thread count is numba's at trace time.
    settings = jnp.asarray([scale, sliding_window, soft_cap or 0.0, numba_ffi.num_threads()], jnp.float32)
    # The result is declared with the heads flattened, f32[T, Hq * D] (the same bytes): a one-row output projection
    # that XLA:CPU fuses reads its input through the buffer's shape, and from f32[1, Hq, D] ran 3x slower.
    flat = jax.ShapeDtypeStruct((q.shape[0], q.shape[1] * q.shape[2]), jnp.float32)
    call = jax.ffi.ffi_call(target(q.shape[-1], k_pages.dtype.name), flat)
    i32 = jnp.int32
    out = call(q, k_pages, v_pages, page_table.astype(i32), context_lens.astype(i32), query_start_loc.astype(i32),
               jnp.asarray(num_seqs, i32).reshape(1), settings)  # fmt: skip
    return out.reshape(q.shape)


def paged_decode_attention(
    q: jax.Array,  # f32[B, Hq, D] one query token per row
    k_pages: jax.Array,  # f32 or f16 [num_pages, page_size, Hkv, D]
    v_pages: jax.Array,  # k_pages' shape and dtype
    page_table: jax.Array,  # i32[B, W]
    lengths: jax.Array,  # i32[B] valid KV tokens incl. the current one (0: no keys, zeros out)
    *,
    scale: float,
    sliding_window: int = 0,
    soft_cap: float | None = None,
) -> jax.Array:  # f32[B, Hq, D]
    """Decode: the ragged kernel with one query token per row."""
    rows = q.shape[0]
    return ragged_paged_attention(q, k_pages, v_pages, page_table, lengths, jnp.arange(rows + 1, dtype=jnp.int32),
                                  jnp.int32(rows), scale=scale, sliding_window=sliding_window,
                                  soft_cap=soft_cap)  # fmt: skip
