"""`MPAsyncEngine`: the server's engine front when the engine core runs in its own process (core_process.py).

A drop-in for `AsyncEngine` as the server uses it (`alive`, `error`, `num_pending()`, `validate()`, async
`generate()` yielding RequestOutput deltas, `abort()`, `shutdown()`, plus `stats()` for /metrics). What stays
on the API side: validation (`Engine.validate` itself, run on the limits the core reported, so that a bad request
is a synchronous ValueError -> 400 exactly as in-process), detokenization and stop strings (`OutputProcessor`;
a stop string found here is sent to the core as "finish"). A reader thread takes results off the socket and hands
each stream its outputs on its event loop; a caller that stops reading is cut off (stream_queue.py).

Locks: the reader thread alone touches the OutputProcessor (detokenization, stop strings): the event loop hands it
its changes (a new request, a closed one) through a queue that the reader applies before each batch of results,
so detokenizing a large batch holds nothing a handler waits for. `_lock` guards the streams table and `error`,
for dict operations only.

When the core process dies (killed, or an exception in its loop), every waiting stream gets EngineDeadError (the
server turns it into 503), `alive` turns false (/health and new requests 503) and `on_death` is called so the
server can exit instead of serving nothing.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import pickle
import queue
import shutil
import signal
import tempfile
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import zmq

from jaxinfer.engine.async_engine import (  # one error for both fronts
    EngineDeadError,
    RequestsEndedError,
    end_streams,
    validate_off_loop,
)
from jaxinfer.engine.core_process import COMMANDS_HWM, pack, params_to_wire, run_core, unpack, update_from_wire
from jaxinfer.engine.outbox import RESULTS_HWM
from jaxinfer.engine.stream_queue import StreamLimits, StreamQueue
from jaxinfer.types import RequestOutput, SamplingParams, with_bad_words_ids

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
    pending_compiles: int = 0  # step programs left to compile while the core is idle (fewer-row mixed steps, rarer)
    cache: dict = dataclasses.field(default_factory=dict)  # Engine.cache_stats(): sessions, host tier
    idle_share: float | None = None  # the step timeline's (--step-timeline), over its recent steps
    device_ms: float | None = None
    host_ms: float | None = None


class _Validator:
    """The attributes `Engine.validate` reads, rebuilt from the core's facts: the API side runs the engine's own
    validation code (same checks, same messages), without a model."""

    def __init__(self, facts: dict):
        from jaxinfer.config import ModelConfig
        from jaxinfer.engine.config import CacheConfig
        from jaxinfer.engine.engine import Engine

        class _Runner:
            num_kv_tokens = facts["num_kv_tokens"]

        self.cfg = ModelConfig.from_dict(facts["config"])
        self.cc = CacheConfig(**facts["cache"])
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
        self.limits = StreamLimits(args.stream_stall_timeout, args.max_stream_buffer)
        self.core_pid: int | None = None
        self._stats = EngineStats()
        self._validator: _Validator | None = None
        self._facts: dict | None = None
        self._load_error: EngineLoadError | None = None
        self._ready = threading.Event()
        self._closing = False
        self._stop_reader = False
        self._streams: dict[str, StreamQueue] = {}
        # The event loop's changes to the processor, applied by the reader thread: ("add", rid, prompt, ids,
        # params) | ("forget", rid) | ("abort", rid).
        self._changes: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # the streams table and `error`: dict operations only
        self._send_lock = threading.Lock()  # the commands socket and _unsent (the event loop and the reader send)
        # Commands the socket would not take yet (COMMANDS_HWM reached: the core is behind), sent first, in order,
        # by the next send or the reader's next poll: the event loop never blocks on the core.
        self._unsent: deque[bytes] = deque()
        self._dir = tempfile.mkdtemp(prefix="jaxinfer-core-")
        self._ctx = zmq.Context()
        self._commands = self._ctx.socket(zmq.PUSH)
        self._commands.setsockopt(zmq.SNDHWM, COMMANDS_HWM)
        self._commands.setsockopt(zmq.LINGER, 0)
        self._results = self._ctx.socket(zmq.PULL)
        self._results.setsockopt(zmq.RCVHWM, RESULTS_HWM)  # past it the core merges its results (outbox.py)
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
        self.sampling_defaults = msg["sampling_defaults"]
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
        """Streams one request's outputs (deltas) until it finishes. Raises ValueError for a bad request,
        SlowReaderError when the caller stopped taking outputs and was cut off."""
        if not self.alive:
            raise EngineDeadError(f"engine is not running: {self.error!r}")
        params = with_bad_words_ids(params, self.tokenizer)
        ids = await validate_off_loop(self.validate, prompt_ids, params)
        stream = StreamQueue(request_id, self.limits, self._cut)
        with self._lock:
            if self.error is not None:  # checked under the lock: a death after this point reaches this stream
                raise EngineDeadError(f"engine is not running: {self.error!r}")
            if request_id in self._streams:
                raise ValueError(f"request_id {request_id!r} is already in use")
            self._streams[request_id] = stream
        self._changes.put(("add", request_id, prompt, ids, params))  # before the core can answer the "add"
        self._send(["add", request_id, ids, params_to_wire(params)])
        finished = False
        try:
            while True:
                item = await stream.get()
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished:
                self._cut(request_id)

    def abort(self, request_id: str) -> None:
        """Aborts the request; its stream ends with a last output (finish_reason "abort")."""
        self._changes.put(("abort", request_id))
        self._send(["abort", request_id])

    def end_all(self, reason: str) -> None:
        """Every open stream raises RequestsEndedError(reason) to its caller, whose leaving aborts its request."""
        end_streams(self._lock, self._streams, RequestsEndedError(reason))

    def _cut(self, request_id: str) -> None:
        """Aborts a request whose stream is gone (closed early, or cut off): no last output."""
        self._changes.put(("forget", request_id))
        self._send(["abort", request_id])

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
            self._unsent.append(data)
            self._send_unsent()

    def _send_unsent(self) -> None:
        """Under _send_lock: the commands waiting, oldest first, until the socket would block."""
        while self._unsent:
            try:
                self._commands.send(self._unsent[0], zmq.NOBLOCK)
            except zmq.Again:  # the core is behind: kept for later (or no core: it died, and so does the server)
                return
            except zmq.ZMQError:  # the socket is closed (shut down): nothing listens any more
                self._unsent.clear()
                return
            self._unsent.popleft()

    # ------------------------------------------------------------------------------------------ reader thread

    def _read_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._results, zmq.POLLIN)
        poller.register(self._proc.sentinel, zmq.POLLIN)  # readable once the process has exited
        try:
            while True:
                events = dict(poller.poll(100))
                self._apply_changes()  # an abort's last output goes out within a poll, results or not
                if self._unsent:
                    with self._send_lock:
                        self._send_unsent()
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
                self.processor.forget(msg["rid"])
                self._deliver(msg["rid"], ValueError(msg["error"]))
            elif kind == "ready":
                self._on_ready(msg)
            elif kind == "failed":
                self._load_error = EngineLoadError(msg["error"], msg["type"])
                self._ready.set()
            elif kind == "dead":
                self._die(f"engine process failed: {msg['type']}: {msg['error']}")

    def _apply_changes(self) -> None:
        """(reader) The event loop's changes to the processor, in the order they were made."""
        while self.processor is not None:  # none can come before "ready" but a stray abort()
            try:
                change = self._changes.get_nowait()
            except queue.Empty:
                return
            op, rid = change[0], change[1]
            if op == "add":
                self.processor.add(rid, *change[2:])
            elif op == "forget":
                self.processor.forget(rid)
            elif op == "abort":
                final = self.processor.abort(rid)
                if final is not None:
                    self._deliver(rid, final)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is not None:
            stream.put_threadsafe(item)

    def _on_outputs(self, msg: dict) -> None:
        self._stats = EngineStats(**msg["s"])
        if not msg["u"]:
            return
        self._apply_changes()  # a request's "add" reaches the processor before its first tokens
        # Detokenization and stop strings, under no lock: the processor is this thread's alone. The processor
        # drops the tokens the core made before it heard of a stop string found here.
        outs = self.processor.process([update_from_wire(w) for w in msg["u"]], self._finish_in_core)
        for out in outs:
            self._deliver(out.request_id, out)

    def _finish_in_core(self, seq_id: str, reason: str, stop_reason: int | str | None) -> None:
        """Ends a sequence the core still runs (a stop string found here)."""
        self._send(["finish", seq_id, reason, stop_reason])

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
        with self._send_lock:  # for a core that is gone
            self._unsent.clear()
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
        end_streams(self._lock, self._streams, error)


def _describe(exitcode: int | None) -> str:
    if exitcode is None:
        return "exit code unknown"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"
