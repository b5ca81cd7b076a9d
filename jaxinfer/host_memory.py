"""Give freed host memory back to the operating system.

glibc keeps freed blocks of up to 32 MiB in its heap for reuse (its mmap threshold rises as large blocks are freed),
so after the engine drops the per-layer weight arrays it stacked for the scanned layer loop, or the temporaries of
compiling its steps, the process's RSS stays up by hundreds of MiB that nothing uses (measured on the default model:
440 MiB after `LLM()`, 350 MiB after warm-up). `malloc_trim` returns them. A no-op where libc has no malloc_trim.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc


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
