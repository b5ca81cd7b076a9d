"""Give freed host memory back to the operating system, keep large blocks for reuse, and keep Python's collector out
of start-up.

glibc keeps freed blocks of up to 32 MiB in its heap for reuse (its mmap threshold rises as large blocks are freed),
so after the engine drops the per-layer weight arrays it stacked for the scanned layer loop, or the temporaries of
compiling its steps, the process's RSS stays up by hundreds of MiB that nothing uses (measured on the default model:
440 MiB after `LLM()`, 350 MiB after warm-up). `malloc_trim` returns them. A no-op where libc has no malloc_trim.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import gc
import threading
from collections.abc import Iterator


@functools.cache
def _glibc(function: str):
    """The C library's `function` (malloc_trim, mallopt), or None where libc lacks it (macOS, musl: not glibc)."""
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), function) if name else None
    except (OSError, AttributeError):
        return None


# mallopt parameters (glibc's malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8


@functools.cache
def reuse_large_blocks() -> bool:
    """Makes glibc keep freed large blocks in its heap for the next allocation instead of unmapping them. Process-wide;
    True where libc took the settings (glibc).

    XLA:CPU allocates a compiled step's temporaries as one block at every call and frees it after: 75.6 MB for a
    128-row decode step of the default model (its logits f32[128, 49152] and the sampler's draw). A block above
    glibc's mmap threshold (32 MiB at most), and any block above 64 MiB from a thread's own arena, is a fresh mapping
    each time, so every page the step writes faults in again, zeroed by the kernel: 6,300 faults a greedy 128-row
    step, 37,000 a sampled one, ~3 us each on a 2-core VM. One arena, no mappings for blocks and no automatic trim
    reuse the block instead: a real 128-row greedy decode step ran 1.13x faster, a sampled one 1.06x
    (benchmarks/README.md). Freed memory then stays in the heap until `release_freed_memory` gives it back, as the
    engine does after loading and warm-up, and `LLM.close` does.

    Whole only before jax starts its CPU client: each thread keeps the arena it first allocated from, and a thread
    of its own arena still maps blocks above 64 MiB. `build_engine` calls it first; a process that ran jax before
    gets the settings for its later threads only."""
    mallopt = _glibc("mallopt")
    if mallopt is None:
        return False
    settings = ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 2**31 - 1))
    return all(mallopt(param, value) == 1 for param, value in settings)


def release_freed_memory() -> bool:
    """Collects garbage, then trims the C heap. True when libc supports it."""
    gc.collect()
    trim = _glibc("malloc_trim")
    if trim is None:
        return False
    trim(0)
    return True


_lock = threading.Lock()
_pauses = 0  # gc_paused blocks open now, over every thread
_resume = False  # whether the collector was on when the first of them began
_freezes = 0  # heap_frozen blocks open now (gc_paused's included)
_thaw = False  # whether the first of them froze the heap (and the last must unfreeze it)


def freeze_for_good() -> None:
    """For a process that lives as long as its engine (a server's): freezes nearly everything its start made (~310k
    objects for the default model) for the rest of its life, so that no later full collection walks them and stalls
    the step loop (~170-245 ms each). Garbage made from here on is collected as usual."""
    gc.freeze()


@contextlib.contextmanager
def heap_frozen() -> Iterator[None]:
    """Keeps the objects that exist when the block begins out of the collector's full collections, for the block.

    A process that has imported jax and flax and built an engine holds ~310k long-lived objects, and each full
    collection walks all of them (~170-245 ms for the default model's engine): `LLM.generate` of 128 requests ran two,
    0.54 s in which the step loop stood still. Frozen (`gc.freeze`), they cost nothing; objects made inside the block
    are collected as usual. After the block they are unfrozen: nothing stays frozen, so a notebook that drops its
    engine gets its memory back as before. A heap that someone froze already is left as it is. Nested and concurrent
    blocks share one freeze."""
    global _freezes, _thaw
    with _lock:
        if _freezes == 0:
            _thaw = gc.get_freeze_count() == 0
            if _thaw:
                gc.freeze()
        _freezes += 1
    try:
        yield
    finally:
        with _lock:
            _freezes -= 1
            if _freezes == 0 and _thaw:
                gc.unfreeze()


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Keeps Python's cyclic garbage collector out of a start-up phase (reference counting still frees).

    Building an engine allocates ~110k objects that live as long as it does, on top of the ~200k that importing jax
    and flax made, and each automatic full collection walks all of them: a warm-up that loaded 22 compiled steps
    ran nine, 1.9 of its 7.3 s. Inside the block automatic collection is off and the heap that existed is frozen
    (`heap_frozen`), so the explicit collections of `release_freed_memory` walk only what the phase made (~60 ms
    instead of ~240). The collector's state is restored after the last block. Nested and concurrent blocks share
    one pause."""
    global _pauses, _resume
    with _lock:
        if _pauses == 0:
            _resume = gc.isenabled()
            gc.disable()
        _pauses += 1
    try:
        with heap_frozen():
            yield
    finally:
        with _lock:
            _pauses -= 1
            if _pauses == 0 and _resume:
                gc.enable()
