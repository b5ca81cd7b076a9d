"""Give freed host memory back to the operating system, and keep Python's collector out of start-up.

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
def _malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to trim
        return None


def release_freed_memory() -> bool:
    """Collects garbage, then trims the C heap. True when libc supports it."""
    gc.collect()
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


_pause_lock = threading.Lock()
_pauses = 0  # gc_paused blocks open now, over every thread
_resume = False  # whether the collector was on when the first of them began
_thaw = False  # whether the first of them froze the heap (and the last must unfreeze it)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Keeps Python's cyclic garbage collector out of a start-up phase (reference counting still frees).

    Building an engine allocates ~110k objects that live as long as it does, on top of the ~200k that importing jax
    and flax made, and each automatic full collection walks all of them: a warm-up that loaded 22 compiled steps
    ran nine, 2.1 of its 7.3 s. Inside the block automatic collection is off, and the objects that existed when it
    began are frozen (`gc.freeze`), so the explicit collections of `release_freed_memory` walk only what the phase
    made (~60 ms instead of ~240). After the block they are unfrozen and the collector's state is restored: nothing
    stays frozen, so a notebook that drops its engine gets its memory back as before. A heap that someone froze
    already is left as it is. Nested and concurrent blocks share one pause."""
    global _pauses, _resume, _thaw
    with _pause_lock:
        if _pauses == 0:
            _resume, _thaw = gc.isenabled(), gc.get_freeze_count() == 0
            gc.disable()
            if _thaw:
                gc.freeze()
        _pauses += 1
    try:
        yield
    finally:
        with _pause_lock:
            _pauses -= 1
            if _pauses == 0:
                if _thaw:
                    gc.unfreeze()
                if _resume:
                    gc.enable()
