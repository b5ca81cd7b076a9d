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
GPU and TPU. While a handler is still building (in a child process), a `Forwarder` stands in for it: a few lines of
LLVM IR that XLA registers and compiles against at once, and that call the handler once it is built.
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import importlib.util
import logging
import os
import threading
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import jax

_log = logging.getLogger(__name__)

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
def compiles_for_avx512() -> bool:
    """Whether numba compiles the kernels for a CPU with AVX-512 (32 vector registers of 16 floats): the host's, as
    llvmlite (numba's compiler) reads its features, unless NUMBA_CPU_NAME names another CPU. False without numba."""
    name = os.environ.get("NUMBA_CPU_NAME", "")
    if name and name != "host":
        return "+avx512f" in os.environ.get("NUMBA_CPU_FEATURES", "")
    if importlib.util.find_spec("llvmlite") is None:
        return False
    from llvmlite import binding

    return bool(binding.get_host_cpu_features().get("avx512f"))


@functools.cache
def load_failure(module: str) -> str | None:
    """Why the numba kernel module `module` cannot load in this process (None: it loaded): numba missing, or the
    module's import failing (ValueError: numba found no thread-safe threading layer)."""
    if importlib.util.find_spec("numba") is None:
        return "numba is not installed"
    try:
        importlib.import_module(module)
    except (ImportError, ValueError) as e:
        return f"the numba kernel did not load ({type(e).__name__}: {e})"
    return None


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


# A forwarding handler, in LLVM IR (opaque pointers: LLVM 15 and later, as every llvmlite numba>=0.61 takes).
# `forward` answers XLA's metadata query and the non-execute stages itself, as `answer_non_execute` does, and calls the
# handler whose address is in the cell at CELL; while the cell is empty it first calls RESOLVER (a ctypes callback that
# builds the handler) and calls the address that returns. `fail` is what a failed build leaves in the cell: it returns
# an FFI error made by the API's XLA_FFI_Error_Create (word 6 of XLA_FFI_Api: struct_size, extension_start, the 3-word
# api_version and internal_api come first) from XLA_FFI_Error_Create_Args {struct_size 28, extension_start, message,
# errc 13 (internal)}.
_FORWARDER_IR = """
@message = private unnamed_addr constant [{length} x i8] c"{message}\\00"

define ptr @forward(ptr %frame) {{
entry:
  %ext_at = getelementptr i64, ptr %frame, i64 1
  %ext = load i64, ptr %ext_at
  %has_ext = icmp ne i64 %ext, 0
  br i1 %has_ext, label %extension, label %stage
extension:
  %ext_ptr = inttoptr i64 %ext to ptr
  %type_at = getelementptr i64, ptr %ext_ptr, i64 1
  %type = load i32, ptr %type_at
  %is_metadata = icmp eq i32 %type, {metadata}
  br i1 %is_metadata, label %version, label %done
version:
  %md_at = getelementptr i64, ptr %ext_ptr, i64 3
  %md = load ptr, ptr %md_at
  %major_at = getelementptr i32, ptr %md, i64 6
  store i32 {major}, ptr %major_at
  %minor_at = getelementptr i32, ptr %md, i64 7
  store i32 {minor}, ptr %minor_at
  br label %done
stage:
  %stage_at = getelementptr i64, ptr %frame, i64 4
  %stage_value = load i32, ptr %stage_at
  %is_execute = icmp eq i32 %stage_value, {execute}
  br i1 %is_execute, label %execute, label %done
execute:
  %cell = inttoptr i64 {cell} to ptr
  %handler = load atomic ptr, ptr %cell acquire, align 8
  %ready = icmp ne ptr %handler, null
  br i1 %ready, label %call, label %resolve
resolve:
  %resolver = inttoptr i64 {resolver} to ptr
  %built = call ptr %resolver()
  br label %call
call:
  %target = phi ptr [ %handler, %execute ], [ %built, %resolve ]
  %result = call ptr %target(ptr %frame)
  ret ptr %result
done:
  ret ptr null
}}

define ptr @fail(ptr %frame) {{
  %api_at = getelementptr i64, ptr %frame, i64 2
  %api = load ptr, ptr %api_at
  %create_at = getelementptr i64, ptr %api, i64 6
  %create = load ptr, ptr %create_at
  %args = alloca {{ i64, ptr, ptr, i32 }}, align 8
  store {{ i64, ptr, ptr, i32 }} {{ i64 28, ptr null, ptr @message, i32 13 }}, ptr %args
  %error = call ptr %create(ptr %args)
  ret ptr %error
}}
"""


class BuildFailed(RuntimeError):
    """A handler registered ahead of its build (a `Forwarder`) failed to build; `__cause__` is why."""


class Forwarder:
    """A handler XLA can register, and compile programs against, before the real one is built: its machine code
    (`address`) forwards each execute call to the handler `build` returns, built by `resolve()` (the engine calls
    `finish_builds` after its warm-up) or else by the first execute call itself, which waits for it. Used while a
    child process builds the real handler (kernels_pallas.ragged_cpu.prebuild), so that XLA compiles the steps
    meanwhile instead of waiting. A build that fails is not retried: the programs that call the target fail with an
    FFI error from then on, without entering Python again."""

    def __init__(self, name: str, build: Callable[[], Any]):
        import llvmlite.binding as llvm
        from numba.core.compiler_lock import global_compiler_lock

        self.name, self._build, self.handler = name, build, None
        self.error: BaseException | None = None  # why the build failed, once it has
        self._lock = threading.Lock()
        self._cell = ctypes.c_uint64(0)  # the address execute calls go to: the handler, or `fail`
        self._resolver = ctypes.CFUNCTYPE(ctypes.c_uint64)(self._resolve_for_xla)  # kept: XLA's code calls it
        message = f"the XLA FFI handler {name} failed to build (the log has the error)"
        ir = _FORWARDER_IR.format(length=len(message.encode()) + 1, message=message, metadata=_METADATA_EXTENSION,
                                  major=_API_MAJOR, minor=_API_MINOR, execute=_EXECUTE,
                                  cell=ctypes.addressof(self._cell),
                                  resolver=ctypes.cast(self._resolver, ctypes.c_void_p).value)  # fmt: skip
        with global_compiler_lock:  # LLVM's global context is numba's too, and numba may be compiling on a thread
            llvm.initialize_native_target()
            llvm.initialize_native_asmprinter()
            module = llvm.parse_assembly(ir)
            module.verify()
            machine = llvm.Target.from_default_triple().create_target_machine()
            self._engine = llvm.create_mcjit_compiler(module, machine)  # kept: it owns the machine code
            self._engine.finalize_object()
            self.address = self._engine.get_function_address("forward")
            self._fail = self._engine.get_function_address("fail")
        _abandon_at_exit()

    @property
    def pending(self) -> bool:
        return self.handler is None and self.error is None

    def resolve(self) -> None:
        """Builds the real handler (waiting for its child, if any) and points the forwarder at it; raises
        `BuildFailed` when the build fails, now or did before (an interrupted build is tried again next time)."""
        with self._lock:
            if self.error is None and self.handler is None:
                try:
                    self.handler = self._build()
                except Exception as e:
                    self.error = e
                    self._cell.value = self._fail
                    _log.error("building the XLA FFI handler %s failed", self.name, exc_info=e)
                else:
                    self._cell.value = self.handler.address
            if self.error is not None:
                raise BuildFailed(f"the XLA FFI handler {self.name} failed to build: {self.error}") from self.error

    def _resolve_for_xla(self) -> int:
        """`resolve` for an execute call that came first, on XLA's thread (ctypes takes the GIL): the address to
        call, the handler's or, where the build failed or was interrupted, `fail`'s."""
        try:
            self.resolve()
        except BuildFailed:  # nothing can raise through XLA's frames: the program fails with the FFI error instead
            return self._fail
        except BaseException as e:  # an interrupt (Ctrl-C during the wait): this program fails, a later one retries
            _log.warning("building the XLA FFI handler %s was interrupted (%r)", self.name, e)
            return self._fail
        return self._cell.value

    def abandon(self) -> None:
        """At exit: execute calls that come now fail at once instead of building (waits for a build in flight)."""
        with self._lock:
            if self.pending:
                self._cell.value = self._fail


@functools.cache
def _abandon_at_exit() -> None:
    """Abandons pending handlers when the interpreter exits: a program still queued on XLA's threads that calls one
    would otherwise call back into a finalizing interpreter, and the process would never exit (seen in a review)."""
    import atexit

    def abandon_pending() -> None:
        for handler in list(_handlers.values()):
            if isinstance(handler, Forwarder):
                handler.abandon()

    atexit.register(abandon_pending)


_handlers: dict[str, Any] = {}  # target name -> its cfunc or Forwarder: XLA calls its code for the process's lifetime
_register_lock = threading.Lock()


def registered(name: str) -> bool:
    """Whether FFI target `name` is registered in this process."""
    return name in _handlers


def register(name: str, build: Callable[[], Any], building: bool = False) -> None:
    """Registers the compiled numba `cfunc` (signature `voidptr(voidptr)`) that `build` returns as XLA:CPU FFI
    target `name`, once: a concurrent caller waits for the first one's build, and the cfunc is kept here.

    `building`: the handler is being built elsewhere (a child process `build` waits for). A `Forwarder` is
    registered at once instead, so that tracing and compiling go on while it builds."""
    with _register_lock:
        if name in _handlers:
            return
        handler = None
        if building:
            try:
                handler = Forwarder(name, build)
            except (ImportError, RuntimeError) as e:  # llvmlite missing, or an LLVM that rejects the IR: wait instead
                _log.warning("cannot register a forwarder for %s (%s: %s); waiting for its build", name,
                             type(e).__name__, e)  # fmt: skip
        if handler is None:
            handler = build()
        new_capsule = ctypes.pythonapi.PyCapsule_New
        new_capsule.restype = ctypes.py_object
        new_capsule.argtypes = (ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)
        capsule = new_capsule(handler.address, b"xla._CUSTOM_CALL_TARGET", None)
        jax.ffi.register_ffi_target(name, capsule, platform="cpu")
        _handlers[name] = handler


def pending() -> bool:
    """Whether a registered target still waits for its handler (`finish_builds` has work)."""
    return any(isinstance(h, Forwarder) and h.pending for h in list(_handlers.values()))


def failed(name: str) -> BaseException | None:
    """Why target `name`'s handler failed to build, where it was registered ahead of a build that failed."""
    handler = _handlers.get(name)
    return handler.error if isinstance(handler, Forwarder) else None


def finish_builds() -> None:
    """Builds every handler registered ahead of its build (waiting for the child processes building them): after
    this, every registered target runs. Raises `BuildFailed` for a build that fails now; one that failed before is
    left alone (its programs fail, and the kernel's `unavailable` reports it, so new traces take another path)."""
    for handler in list(_handlers.values()):
        if isinstance(handler, Forwarder) and handler.pending:
            handler.resolve()
