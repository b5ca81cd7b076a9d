"""XLA FFI handlers written in Python and compiled by numba: CPU kernels that `jax.jit` programs call.

XLA:CPU calls a custom-call target as `XLA_FFI_Error* handler(XLA_FFI_CallFrame*)` (jaxlib's
`include/xla/ffi/api/c_api.h`). A numba `cfunc` of that signature reads the call frame as 8-byte words (every field
the handlers need is a pointer, a size or an enum padded to 8 bytes on the 64-bit ABIs jaxlib ships for), answers
XLA's metadata query and its non-execute stages, and hands the buffers of an execute call to `njit` code as numpy
arrays. Only buffers are used (no attributes): a handler's static settings travel as a small operand.

Layouts read here (c_api.h, FFI API 0.x):
  XLA_FFI_CallFrame: [0] struct_size [1] extension_start [2] api [3] ctx [4] stage [5..9] args [10..14] rets ...
  XLA_FFI_Args / XLA_FFI_Rets: [0] struct_size [1] extension_start [2] size [3] types [4] pointers to buffers
  XLA_FFI_Buffer: [0] struct_size [1] extension_start [2] dtype [3] data [4] rank [5] dims
  XLA_FFI_Metadata_Extension: [0] struct_size [1] type [2] next [3] metadata; the api_version fields (major, minor)
  of XLA_FFI_Metadata are its int32 words 6 and 7.

numba is imported only when a handler is first built (`jit_helpers`), so importing the kernels costs nothing on
GPU and TPU.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import jax

# XLA_FFI_ExecutionStage_EXECUTE; the other stages (instantiate, prepare, initialize) have nothing to do here.
_EXECUTE = 3
_METADATA_EXTENSION = 1
# The FFI API version the handlers are written against (XLA_FFI_API_MAJOR/MINOR of the oldest jaxlib supported).
_API_MAJOR, _API_MINOR = 0, 1


def num_threads() -> int:
    """The threads a handler's parallel loop runs on: numba's count (NUMBA_NUM_THREADS, else the cores), read
    without importing numba."""
    value = os.environ.get("NUMBA_NUM_THREADS", "")
    return int(value) if value.isdigit() and int(value) > 0 else (os.cpu_count() or 1)


@functools.cache
def start_threads() -> None:
    """Starts numba's threading layer. Call it before any cached parallel code loads: that code links against the
    layer's symbols (without this, machine code loaded from numba's cache aborts on an unresolved `allocate_sched`).
    Raises ValueError when no thread-safe layer loads."""
    import numba
    from numba.np.ufunc.parallel import _launch_threads

    if "NUMBA_THREADING_LAYER" not in os.environ:
        # workqueue, numba's last resort, aborts the process when two threads launch parallel loops at once (two
        # engines in one process, or XLA running two programs); omp and tbb do not.
        numba.config.THREADING_LAYER = "threadsafe"
    _launch_threads()


@functools.cache
def jit_helpers() -> SimpleNamespace:
    """The njit helpers handlers are written with: words, answer_non_execute, buffer, dim, data, null."""
    import numpy as np
    from numba import carray, njit, types
    from numba.core.extending import intrinsic

    @intrinsic
    def as_ptr(typingctx, addr):
        """int64 address -> void* (numba has no cast between the two)."""

        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], context.get_value_type(types.voidptr))

        return types.voidptr(types.int64), codegen

    @njit(inline="always")
    def words(addr, n):
        """The n 8-byte words at `addr`."""
        return carray(as_ptr(addr), (n,), dtype=np.int64)

    @njit(inline="always")
    def answer_non_execute(frame) -> bool:
        """True when the call is not an execute call (the handler then returns success at once): XLA's metadata
        query (the API version is written back) or an instantiate/prepare/initialize stage."""
        if frame[1] != 0:
            ext = words(frame[1], 4)
            if (ext[1] & 0xFFFFFFFF) == _METADATA_EXTENSION:
                version = carray(as_ptr(ext[3]), (8,), dtype=np.int32)
                version[6] = _API_MAJOR
                version[7] = _API_MINOR
            return True
        return (frame[4] & 0xFFFFFFFF) != _EXECUTE

    @njit(inline="always")
    def buffer(frame, i, is_ret):
        """Argument (or result) i as its 6 XLA_FFI_Buffer words."""
        pointers = frame[14] if is_ret else frame[9]
        return words(words(pointers, i + 1)[i], 6)

    @njit(inline="always")
    def dim(buf, axis):
        return words(buf[5], buf[4])[axis]

    @njit(inline="always")
    def data(buf):
        return as_ptr(buf[3])

    @njit(inline="always")
    def null():
        """A handler's return value for success: a null XLA_FFI_Error*."""
        return as_ptr(0)

    return SimpleNamespace(words=words, answer_non_execute=answer_non_execute, buffer=buffer, dim=dim, data=data,
                           null=null)  # fmt: skip


_handlers: dict[str, Any] = {}  # target name -> its cfunc: XLA calls its machine code for the process's lifetime
_register_lock = threading.Lock()


def registered(name: str) -> bool:
    """Whether FFI target `name` is registered in this process."""
    return name in _handlers


def register(name: str, build: Callable[[], Any]) -> None:
    """Registers the compiled numba `cfunc` (signature `voidptr(voidptr)`) that `build` returns as XLA:CPU FFI
    target `name`, once: a concurrent caller waits for the first one's build, and the cfunc is kept here."""
    with _register_lock:
        if name in _handlers:
            return
        handler = build()
        new_capsule = ctypes.pythonapi.PyCapsule_New
        new_capsule.restype = ctypes.py_object
        new_capsule.argtypes = (ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)
        capsule = new_capsule(handler.address, b"xla._CUSTOM_CALL_TARGET", None)
        jax.ffi.register_ffi_target(name, capsule, platform="cpu")
        _handlers[name] = handler
