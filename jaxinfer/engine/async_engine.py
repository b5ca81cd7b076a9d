"""An asyncio front for the engine: the engine loop runs in a background thread; callers stream outputs.

    async for out in engine.generate(prompt_ids, params, request_id):   # RequestOutput deltas (output.py)
        ...

Leaving the `async for` early (a client disconnect cancels the task) aborts the request, and its pages return
to the pool on the engine thread's next turn; so does a caller that stops reading (stream_queue.py). Only the
engine thread touches the Engine and the OutputProcessor (detokenization); other threads talk to it through a
command queue. The lock guards the streams table only, and nothing slow runs under it.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import weakref
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from jaxinfer.engine.output import OutputProcessor
from jaxinfer.engine.stream_queue import StreamLimits, StreamQueue
from jaxinfer.tokenizer import Tokenizer
from jaxinfer.types import RequestOutput, SamplingParams, with_bad_words_ids

if TYPE_CHECKING:  # the HTTP process imports this module for EngineDeadError: no jax there
    from jaxinfer.engine.engine import Engine

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread died; no request can be served."""


class RequestsEndedError(RuntimeError):
    """`end_all`: the request was ended before it finished (a server's drain timeout); the engine lives on."""


def end_streams(lock: threading.Lock, streams: dict, error: BaseException) -> None:
    """Puts `error` in every stream of `streams` (request id -> StreamQueue, guarded by `lock`)."""
    with lock:
        waiting = list(streams.values())
    for stream in waiting:
        stream.put_threadsafe(error)


# Prompts longer than this are validated on a worker thread: checking every id of a 100k-token prompt takes tens
# of milliseconds, which the event loop's other streams would wait for.
VALIDATE_ON_LOOP_TOKENS = 2048


async def validate_off_loop(validate: Callable[[list[int], SamplingParams], list[int]], prompt_ids: list[int],
                            params: SamplingParams) -> list[int]:  # fmt: skip
    """`validate(prompt_ids, params)`, on a worker thread when the prompt is long."""
    if len(prompt_ids) <= VALIDATE_ON_LOOP_TOKENS:
        return validate(prompt_ids, params)
    return await asyncio.to_thread(validate, prompt_ids, params)


class AsyncEngine:
    def __init__(self, engine: Engine, tokenizer: Tokenizer, max_waiting: int | None = None,
                 limits: StreamLimits | None = None):  # fmt: skip
        """`limits`: when a stream whose caller stopped reading is cut off (default StreamLimits())."""
        if getattr(engine, "driver", None) is not None:
            raise RuntimeError("an AsyncEngine drives this engine already: shut it down first")
        engine.driver = self  # one thread steps an engine: LLM.generate refuses while this one runs
        self.engine = engine
        self.tokenizer = tokenizer
        self.max_waiting = max_waiting
        self.limits = limits or StreamLimits()
        self.processor = OutputProcessor(tokenizer)
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, StreamQueue] = {}  # the callers' streams, by request id (the caller side's)
        # The engine thread's: the stream each request in the engine delivers to. A stream closed early and a new
        # one under the same id (a retry) are told apart here, by the order of their commands.
        self._targets: dict[str, StreamQueue] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.error: BaseException | None = None
        # The thread holds this object only while it works (see _drive): one nobody holds any more is collected, with
        # its engine when nothing else holds that (a notebook cell run again, the old one never shut down).
        self._thread = threading.Thread(target=_drive, args=(weakref.ref(self), self._wake, self._stop),
                                        name="jaxinfer-engine", daemon=True)  # fmt: skip
        self._thread.start()

    # ------------------------------------------------------------------------------------------ caller side

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def num_pending(self) -> int:
        with self._lock:
            return len(self._streams)

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> list[int]:
        return self.engine.validate(prompt_ids, params)

    @property
    def sampling_defaults(self) -> dict[str, float | int]:
        return self.engine.sampling_defaults

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str, prompt: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Streams one request's outputs (deltas) until it finishes. Raises ValueError for a bad request,
        SlowReaderError when the caller stopped taking outputs and was cut off."""
        if not self.alive:
            raise EngineDeadError(f"engine is not running: {self.error!r}")
        params = with_bad_words_ids(params, self.tokenizer)
        ids = await validate_off_loop(self.engine.validate, prompt_ids, params)
        stream = StreamQueue(request_id, self.limits, self.abort)
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request_id {request_id!r} is already in use")
            self._streams[request_id] = stream
        self._send(("add", request_id, prompt, ids, params, stream))
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
            if not finished:  # closed early: its request ends, and nothing more is delivered to it
                self._send(("cut", request_id, stream))

    def abort(self, request_id: str) -> None:
        """Aborts the request; its stream ends with a last output (finish_reason "abort")."""
        self._send(("abort", request_id))

    def end_all(self, reason: str) -> None:
        """Every open stream raises RequestsEndedError(reason) to its caller, whose leaving aborts its request."""
        end_streams(self._lock, self._streams, RequestsEndedError(reason))

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)
        if not self._thread.is_alive():  # only the engine thread touches the engine while it runs
            self.engine.release_sessions()
        followers = getattr(getattr(self.engine, "runner", None), "followers", None)
        if followers is not None:  # multi-host: release the follower processes
            followers.stop()

    def _send(self, cmd: tuple) -> None:
        self._commands.put(cmd)
        self._wake.set()

    # ------------------------------------------------------------------------------------------ engine thread

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        stream = self._targets.get(request_id)
        if stream is not None:
            stream.put_threadsafe(item)
            if isinstance(item, RequestOutput) and item.finished:
                del self._targets[request_id]

    def _drain_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                _, rid, prompt, ids, params, stream = cmd
                try:
                    self.engine.add_request(ids, params, rid)
                    self.processor.add(rid, prompt, ids, params)
                    self._targets[rid] = stream
                except Exception as e:  # validated already; a race (duplicate id) still must not kill the loop
                    stream.put_threadsafe(e)
            elif cmd[0] == "cut":
                _, rid, stream = cmd
                if self._targets.get(rid) is stream:  # still its request (not one that finished meanwhile)
                    del self._targets[rid]
                    self.engine.abort(rid)
                    self.processor.forget(rid)
            elif cmd[0] == "abort":
                self.engine.abort(cmd[1])
                final = self.processor.abort(cmd[1])  # finish_reason "abort": a caller still waiting returns
                if final is not None:
                    self._deliver(cmd[1], final)
                self._targets.pop(cmd[1], None)

    def _pass(self) -> bool:
        """One pass of the engine thread: the callers' commands, then a step when there is work. False: idle."""
        self._drain_commands()
        if not self.engine.has_unfinished():
            self.engine.expire_sessions()  # idle: pinned conversations still time out
            return False
        outs = self.processor.process(self.engine.step(), self.engine.finish_sequence)
        for out in outs:
            self._deliver(out.request_id, out)
        return True

    def _died(self, e: BaseException) -> None:
        """Surfaces the engine thread's failure to every waiting caller instead of hanging them."""
        log.error("engine loop died", exc_info=e)
        self.error = e
        end_streams(self._lock, self._streams, EngineDeadError(f"engine failed: {e!r}"))
        self.engine.driver = None

    def _stopped(self) -> None:
        """Shut down: streams still open end now, and their requests give their pages back."""
        try:
            for rid in list(self._targets):
                self.engine.abort(rid)
                self.processor.forget(rid)
            self._targets.clear()
            end_streams(self._lock, self._streams, EngineDeadError("the AsyncEngine was shut down"))
        finally:
            self.engine.driver = None


def _drive(ref: weakref.ref[AsyncEngine], wake: threading.Event, stop: threading.Event) -> None:
    """The engine thread. It holds its AsyncEngine only during a pass, never while idle: an AsyncEngine that nobody
    holds (nor its engine, whose `driver` it is) is collected, and the thread ends, instead of keeping both, and
    gigabytes of weights and KV pools, for the life of the process."""
    while not stop.is_set():
        ae = ref()
        if ae is None:
            return  # collected: no caller can read its streams, and its engine went with it
        try:
            busy = ae._pass()
        except BaseException as e:
            ae._died(e)
            return
        if not busy:
            del ae
            wake.wait(0.05)
            wake.clear()
    ae = ref()
    if ae is not None:
        ae._stopped()
