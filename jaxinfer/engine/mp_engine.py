"""`MPAsyncEngine`: the server's engine front when the engine core runs in its own process (core_process.py).

A drop-in for `AsyncEngine` as the server uses it (`alive`, `error`, `num_pending()`, `validate()`, async
`generate()` yielding cumulative RequestOutputs, `abort()`, `shutdown()`, plus `stats()` for /metrics). What stays
on the API side: validation (`Engine.validate` itself, run on the limits the core reported, so that a bad request
is a synchronous ValueError -> 400 exactly as in-process), detokenization and stop strings (`OutputProcessor`;
a stop string found here is sent to the core as "finish"). A reader thread takes results off the socket and hands
each stream its outputs on its event loop.

When the core process dies (killed, or an exception in its loop), every waiting stream gets EngineDeadError (the
server turns it into 503), `alive` turns false (/health and new requests 503) and `on_death` is called so the
server can exit instead of serving nothing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing
import os
import pickle
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import zmq

from jaxinfer.engine.async_engine import EngineDeadError  # one error for both fronts
from jaxinfer.engine.core_process import pack, params_to_wire, run_core, unpack, update_from_wire
from jaxinfer.types import RequestOutput, SamplingParams

log = logging.getLogger(__name__)


class EngineLoadError(RuntimeError):
    """The engine process could not load the model; `remote_type` is the exception's type there."""

    def __init__(self, message: str, remote_type: str = "RuntimeError"):
        super().__init__(message)
        self.remote_type = remote_type


@dataclass
class EngineStats:
    running: int = 0
    waiting: int = 0
    pages_used: int = 0
    pages_total: int = 0
    hit_rate: float = 0.0
    prefilled_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0
    compiles: int = 0  # XLA compilations in the engine process so far
    cache: dict = dataclasses.field(default_factory=dict)  # Engine.cache_stats(): sessions, host tier
    idle_share: float | None = None  # the step timeline's (--step-timeline), over its recent steps
    device_ms: float | None = None
    host_ms: float | None = None


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    seq_ids: list[str]
    request_id: str = ""
    last_take: float = 0.0  # when the caller last took an output (monotonic)
    cut: bool = False  # cut off as a slow reader: nothing more is queued


class SlowReaderError(RuntimeError):
    """The stream's caller stopped taking its outputs: the request was aborted to bound what it holds."""


class _Validator:
    """The attributes `Engine.validate` reads, rebuilt from the core's facts: the API side runs the engine's own
    validation code (same checks, same messages), without a model."""

    def __init__(self, facts: dict):
        from jaxinfer.cache.pages import PageAllocator
        from jaxinfer.config import ModelConfig
        from jaxinfer.engine.config import CacheConfig
        from jaxinfer.engine.engine import Engine

        class _Pool:
            pages_for = PageAllocator.pages_for

            def __init__(self, num_pages: int, page_size: int):
                self.num_pages, self.page_size = num_pages, page_size

        class _Runner:
            num_kv_tokens = facts["num_kv_tokens"]

        self.cfg = ModelConfig.from_dict(facts["config"])
        self.cc = CacheConfig(**facts["cache"])
        self.allocator = _Pool(facts["num_pages"], facts["page_size"])
        self.runner = _Runner()
        self.eos_token_ids = tuple(facts["eos_token_ids"])
        self._validate = Engine.validate

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> list[int]:
        return self._validate(self, prompt_ids, params)


class MPAsyncEngine:
    """Starts the engine core process at once; `wait_ready()` blocks until it serves (or raises EngineLoadError)."""

    def __init__(self, args: Any, on_death: Callable[[], None] | None = None, build: Callable | None = None):
        """`args`: the server's ServerArgs. `build`: a module-level function for the core to build its engine with
        (see `run_core`; tests), default the server's loader."""
        self.args = args
        self.max_waiting = args.max_waiting
        self.on_death = on_death
        self.error: BaseException | None = None
        self.tokenizer = None
        self.processor = None
        self.max_model_len = 0
        self.kv_tokens = 0
        self.max_logprobs = args.max_logprobs
        self.stream_stall_timeout = args.stream_stall_timeout
        self.max_stream_buffer = args.max_stream_buffer
        self.core_pid: int | None = None
        self._stats = EngineStats()
        self._validator: _Validator | None = None
        self._facts: dict | None = None
        self._load_error: EngineLoadError | None = None
        self._ready = threading.Event()
        self._closing = False
        self._stop_reader = False
        self._streams: dict[str, _Stream] = {}
        self._stopped: set[str] = set()  # sequences a stop string ended here: the core's late tokens are dropped
        self._lock = threading.Lock()  # the streams, the processor and `error`
        self._send_lock = threading.Lock()  # the commands socket (the event loop and the reader thread send)
        self._dir = tempfile.mkdtemp(prefix="jaxinfer-core-")
        self._ctx = zmq.Context()
        self._commands = self._ctx.socket(zmq.PUSH)
        self._commands.setsockopt(zmq.SNDHWM, 0)  # never block the event loop: queue instead
        self._commands.setsockopt(zmq.LINGER, 0)
        self._results = self._ctx.socket(zmq.PULL)
        self._results.setsockopt(zmq.RCVHWM, 0)
        commands_addr, results_addr = f"ipc://{self._dir}/commands", f"ipc://{self._dir}/results"
        self._commands.bind(commands_addr)
        self._results.bind(results_addr)
        spawn = multiprocessing.get_context("spawn")  # jax is not fork-safe
        self._proc = spawn.Process(
            target=run_core, args=(dataclasses.asdict(args), commands_addr, results_addr, os.getpid(), build),
            name="jaxinfer-engine-core", daemon=True,
        )  # fmt: skip
        self._proc.start()
        self.core_pid = self._proc.pid
        log.info("engine core process started (pid %d)", self._proc.pid)
        self._thread = threading.Thread(target=self._read_loop, name="jaxinfer-engine-results", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------------------------ start-up

    def wait_ready(self, timeout: float | None = None) -> None:
        """Blocks until the core has loaded and warmed up the model. Raises EngineLoadError when it failed."""
        import jaxinfer.engine.engine  # noqa: F401 - for validation; imports jax (seconds) while the core loads

        if not self._ready.wait(timeout):
            raise TimeoutError(f"the engine process was not ready after {timeout}s")
        if self._load_error is not None:
            raise self._load_error
        if self._validator is None:  # the facts came with "ready"; the engine module (jax) is imported here
            self._validator = _Validator(self._facts)

    def _on_ready(self, msg: dict) -> None:
        from jaxinfer.engine.output import OutputProcessor

        self.tokenizer = pickle.loads(msg.pop("tokenizer"))
        self.processor = OutputProcessor(self.tokenizer)
        self.max_model_len = msg["max_model_len"]
        self.kv_tokens = msg["num_kv_tokens"]
        self.max_logprobs = msg["max_logprobs"]
        self._stats = EngineStats(**msg.pop("stats"))
        self.core_pid = msg["pid"]
        self._facts = msg
        self._ready.set()

    # ------------------------------------------------------------------------------------------ caller side

    @property
    def alive(self) -> bool:
        return self._validator is not None and self.error is None

    def num_pending(self) -> int:
        with self._lock:
            return len(self._streams)

    def stats(self) -> EngineStats:
        return self._stats

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> list[int]:
        assert self._validator is not None, "validate() before the engine was ready"
        return self._validator.validate(prompt_ids, params)

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str, prompt: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Streams cumulative outputs of one request until it finishes. Raises ValueError for a bad request."""
        if not self.alive:
            raise EngineDeadError(f"engine is not running: {self.error!r}")
        ids = self.validate(prompt_ids, params)
        sids = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), sids, request_id, time.monotonic())
        with self._lock:
            if self.error is not None:  # checked under the lock: a death after this point reaches this stream
                raise EngineDeadError(f"engine is not running: {self.error!r}")
            if request_id in self._streams:
                raise ValueError(f"request_id {request_id!r} is already in use")
            self._streams[request_id] = stream
            self.processor.add(request_id, prompt, ids, params)
        self._send(["add", request_id, ids, params_to_wire(params)])
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                stream.last_take = time.monotonic()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
                self._stopped.difference_update(sids)
                if not finished:
                    self.processor.forget(request_id)
            if not finished:
                self._send(["abort", request_id])

    def abort(self, request_id: str) -> None:
        self._send(["abort", request_id])
        with self._lock:
            final = self.processor.abort(request_id) if self.processor is not None else None
            stream = self._streams.get(request_id)
        if final is not None and stream is not None:
            self._deliver(stream, final)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stops the core (a "shutdown" command, then SIGKILL if it does not exit in `timeout`) and the reader."""
        if self._closing:
            return
        self._closing = True
        if self._proc.is_alive():
            if self._ready.is_set() and self._load_error is None:
                self._send(["shutdown"])
                self._proc.join(timeout)
            if self._proc.is_alive():  # still loading (nothing to save), or stuck
                if self._ready.is_set():
                    log.warning("engine core (pid %d) did not stop in %.0fs: killing it", self._proc.pid, timeout)
                self._proc.kill()
                self._proc.join(10)
        if not self._ready.is_set():
            self._load_error = EngineLoadError("the engine process was stopped during start-up")
            self._ready.set()
        self._stop_reader = True
        self._thread.join(5)
        self._fail_streams(EngineDeadError("the engine was shut down"))
        if self._thread.is_alive():  # closing its sockets under it could hang: leave them to the process's end
            log.warning("engine results reader did not stop")
            return
        with self._send_lock:  # a late abort (a stream closing after this) finds a closed socket, not a half one
            self._commands.close(linger=0)
        self._results.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)
        log.info("engine core process stopped (exit code %s)", self._proc.exitcode)

    def _send(self, cmd: list) -> None:
        data = pack(cmd)
        with self._send_lock:
            try:
                self._commands.send(data, zmq.NOBLOCK)
            except zmq.ZMQError:  # no core connected (it died, or shut down): nothing listens any more
                pass

    # ------------------------------------------------------------------------------------------ reader thread

    def _deliver(self, stream: _Stream, item: RequestOutput | BaseException) -> None:
        try:
            stream.loop.call_soon_threadsafe(self._put, stream, item)
        except RuntimeError:  # the caller's event loop is closed: nobody is listening any more
            pass

    def _put(self, stream: _Stream, item: RequestOutput | BaseException) -> None:
        """On the caller's event loop. A caller that stopped taking outputs (an HTTP client that stopped reading,
        without disconnecting: its response task waits on the socket) is cut off once `max_stream_buffer` outputs
        wait for it, or its oldest waiting output is `stream_stall_timeout` seconds old: the request is aborted
        (its pages return to the pool) and the caller finds a SlowReaderError when it reads again."""
        if stream.cut:
            return
        q = stream.queue
        stalled = q.qsize() > 0 and time.monotonic() - stream.last_take > self.stream_stall_timeout
        if isinstance(item, BaseException) or not (q.qsize() >= self.max_stream_buffer or stalled):
            q.put_nowait(item)
            return
        stream.cut = True
        log.warning("request %s: its client stopped reading (%d outputs waiting); aborting it", stream.request_id,
                    q.qsize())  # fmt: skip
        self._send(["abort", stream.request_id])
        with self._lock:
            self.processor.forget(stream.request_id)
        while not q.empty():  # what it would never read: dropped now, not when the connection finally closes
            q.get_nowait()
        q.put_nowait(SlowReaderError(f"request {stream.request_id} aborted: its client stopped reading"))

    def _read_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._results, zmq.POLLIN)
        poller.register(self._proc.sentinel, zmq.POLLIN)  # readable once the process has exited
        try:
            while True:
                events = dict(poller.poll(100))
                if self._results in events:
                    self._drain_results()
                elif self._proc.sentinel in events:
                    # Exited: take what it sent before dying (a "dead" message names the error), then mourn.
                    if self._results.poll(200):
                        continue
                    self._on_exit()
                    return
                elif self._stop_reader:
                    return
        except Exception as e:  # a bug here must not leave every stream hanging
            log.exception("engine results reader failed")
            self._die(f"the engine results reader failed: {e!r}")

    def _drain_results(self) -> None:
        while True:
            try:
                raw = self._results.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            msg = unpack(raw)
            kind = msg["t"]
            if kind == "out":
                self._on_outputs(msg)
            elif kind == "err":
                with self._lock:
                    stream = self._streams.get(msg["rid"])
                    self.processor.forget(msg["rid"])
                if stream is not None:
                    self._deliver(stream, ValueError(msg["error"]))
            elif kind == "ready":
                self._on_ready(msg)
            elif kind == "failed":
                self._load_error = EngineLoadError(msg["error"], msg["type"])
                self._ready.set()
            elif kind == "dead":
                self._die(f"engine process failed: {msg['type']}: {msg['error']}")

    def _on_outputs(self, msg: dict) -> None:
        self._stats = EngineStats(**msg["s"])
        if not msg["u"]:
            return
        updates = [update_from_wire(w) for w in msg["u"]]
        with self._lock:
            if self._stopped:
                # Tokens the core made before it heard of a stop string found here: not part of the output.
                updates = [u for u in updates if u.request_id not in self._stopped]
            outs, to_stop = self.processor.process(updates)
            self._stopped.update(sid for sid, _ in to_stop)
            deliveries = [(self._streams.get(out.request_id), out) for out in outs]
        for sid, reason in to_stop:
            self._send(["finish", sid, "stop", reason])
        for stream, out in deliveries:
            if stream is not None:
                self._deliver(stream, out)

    def _on_exit(self) -> None:
        self._proc.join(1)
        code = self._proc.exitcode
        if self._closing or self._load_error is not None:  # expected: we stopped it, or it failed to load
            return
        if not self._ready.is_set():
            self._load_error = EngineLoadError(f"the engine process exited during start-up ({_describe(code)})")
            self._ready.set()
            return
        self._die(f"the engine process died ({_describe(code)})")

    def _die(self, reason: str) -> None:
        if self._closing or self.error is not None:
            return
        log.error("%s", reason)
        self._fail_streams(EngineDeadError(reason))
        if not self._ready.is_set():
            self._load_error = EngineLoadError(reason)
            self._ready.set()
        elif self.on_death is not None:
            self.on_death()

    def _fail_streams(self, error: EngineDeadError) -> None:
        with self._lock:
            if self.error is None:
                self.error = error
            streams = list(self._streams.values())
        for stream in streams:
            self._deliver(stream, error)


def _describe(exitcode: int | None) -> str:
    if exitcode is None:
        return "exit code unknown"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"
