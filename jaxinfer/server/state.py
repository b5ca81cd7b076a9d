"""The server's lifetime (starting -> ready -> stopping, or failed) and its admission counters.

The model loads on a background thread so that the HTTP side answers (503) while it starts. Everything here is
touched from the event loop thread only, except `_load`, which publishes the engine and then flips the phase.

The engine runs in its own process (`MPAsyncEngine`, --engine-process, the default) or on a thread of this one
(`AsyncEngine`): always the latter with an injected loader (tests) or several hosts (the lead's runner talks to
the followers from this process).
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from jaxinfer.errors import user_errors
from jaxinfer.server.args import ServerArgs
from jaxinfer.server.body import BodyReads
from jaxinfer.server.errors import APIError

if TYPE_CHECKING:
    from jaxinfer.engine.async_engine import AsyncEngine
    from jaxinfer.engine.mp_engine import MPAsyncEngine
    from jaxinfer.tokenizer import Tokenizer

log = logging.getLogger(__name__)

Loader = Callable[[ServerArgs], tuple[Any, "Tokenizer"]]  # -> (Engine, Tokenizer)


def _build_engine(args: ServerArgs) -> tuple[Any, Tokenizer]:
    """The in-process engine: `jaxinfer.engine.build.build_engine`, imported here so that jax loads only when an
    engine does (the HTTP side starts listening first)."""
    from jaxinfer.engine.build import build_engine

    return build_engine(args)


class Phase(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    FAILED = "failed"
    STOPPING = "stopping"


class ServerState:
    def __init__(self, args: ServerArgs, loader: Loader | None = None, engine: MPAsyncEngine | None = None):
        """`loader` builds an in-process engine; None: the real one, in a process of its own unless
        --no-engine-process (or several hosts) says otherwise. `engine`: that process, started already
        (`jaxinfer.cli.run_server` starts it before it imports the app), which the loading then waits for instead
        of starting one."""
        self.args = args
        self.engine_process = engine is not None or (loader is None and args.separate_engine_process)
        self._loader = loader or _build_engine
        self.phase = Phase.STARTING
        self.error: str | None = None
        self.engine: AsyncEngine | MPAsyncEngine | None = None
        self.tokenizer: Tokenizer | None = None
        self.max_model_len = 0
        self.kv_tokens = 0
        self.max_logprobs = args.max_logprobs
        self.in_flight = 0  # engine requests admitted and not finished
        self.waiting = 0  # sequences (prompts x n) without a first token yet (the --max-waiting bound)
        self.body_reads = BodyReads()  # request bodies arriving: the end of a drain stops them (503)
        self.on_fatal: Callable[[], None] | None = None  # set by the runner: stop serving when loading fails
        # Set by the runner: the engine process died after start-up (called from a reader thread; flags only).
        self.on_engine_dead: Callable[[], None] | None = None
        # Whether the app's lifespan starts the loading; DrainingServer clears it and starts it once listening.
        self.load_on_lifespan = True
        self._thread: threading.Thread | None = None
        self._starting: MPAsyncEngine | None = engine  # the engine process while it loads, so shutdown can stop it
        self._start_lock = threading.Lock()

    # ------------------------------------------------------------------------------------------ lifetime

    def start_loading(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._load, name="jaxinfer-loader", daemon=True)
        self._thread.start()

    @property
    def loading(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _load(self) -> None:
        try:
            t0 = time.perf_counter()
            if self.engine_process:
                self._start_engine_process()
            else:
                self._load_in_process()
            if self.engine is None:  # stopped while loading
                return
            if self.phase is Phase.STARTING:  # a SIGTERM during loading keeps the server stopping
                self.phase = Phase.READY
            log.info("ready in %.1fs: serving %s", time.perf_counter() - t0, ", ".join(self.args.model_names))
        except BaseException as e:
            if self.phase is Phase.STOPPING:  # the engine process was stopped under the loading: not a failure
                log.info("loading stopped: the server is shutting down")
                return
            name = getattr(e, "remote_type", None)  # failed in the engine process, which logged the traceback
            if name is None:  # in this process (--no-engine-process): a traceback only for a bug, as there
                log.log(logging.DEBUG if isinstance(e, user_errors()) else logging.ERROR, "loading the model failed",
                        exc_info=True)  # fmt: skip
                name = type(e).__name__
            self.error = f"loading the model failed: {name}: {e}"
            self.phase = Phase.FAILED
            if self.on_fatal is not None:
                self.on_fatal()

    def _load_in_process(self) -> None:
        from jaxinfer.engine.async_engine import AsyncEngine
        from jaxinfer.engine.stream_queue import StreamLimits

        engine, tokenizer = self._loader(self.args)
        # Compile every program variant a request can select now (prompt logprobs included), so that no
        # request waits for a compilation.
        from jaxinfer.startup import warm_up

        log.info("compiled steps warmed up in %.1fs", warm_up(engine, prompt_logprobs=True).seconds)
        self.tokenizer = tokenizer
        self.max_model_len = engine.cc.max_model_len
        self.kv_tokens = engine.largest().runner.num_kv_tokens  # a DataParallelEngine's largest replica
        self.max_logprobs = engine.cc.max_logprobs
        limits = StreamLimits(self.args.stream_stall_timeout, self.args.max_stream_buffer)
        self.engine = AsyncEngine(engine, tokenizer, self.args.max_waiting, limits)

    def _start_engine_process(self) -> None:
        from jaxinfer.engine.mp_engine import MPAsyncEngine

        with self._start_lock:
            if self.phase is not Phase.STARTING:
                return
            engine = self._starting = self._starting or MPAsyncEngine(self.args)
            engine.on_death = self._engine_died
        engine.wait_ready()  # the core process loads the model and compiles its steps
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.kv_tokens = engine.kv_tokens
        self.max_logprobs = engine.max_logprobs
        self.engine = engine

    def _engine_died(self) -> None:
        if self.on_engine_dead is not None:
            self.on_engine_dead()

    def begin_stopping(self) -> None:
        if self.phase is not Phase.FAILED:
            self.phase = Phase.STOPPING

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._start_lock:
            self.begin_stopping()
            engine = self.engine or self._starting
        if engine is not None:
            engine.shutdown(timeout)
            log.info("engine shut down")

    # ------------------------------------------------------------------------------------------ requests

    def unavailable(self) -> APIError | None:
        """Why no request can be served now, or None when one can."""
        if self.phase is Phase.STARTING:
            return APIError(503, "the model is still loading; retry shortly", code="model_loading")
        if self.phase is Phase.FAILED:
            return APIError(503, self.error or "the model failed to load", code="model_load_failed")
        if self.phase is Phase.STOPPING:
            return APIError(503, "the server is shutting down", code="shutting_down")
        if self.engine is None or not self.engine.alive:
            err = self.engine.error if self.engine is not None else None
            return APIError(503, f"the engine stopped: {err!r}", code="engine_dead")
        return None

    def require_ready(self) -> AsyncEngine:
        err = self.unavailable()
        if err is not None:
            raise err
        assert self.engine is not None
        return self.engine

    def admit(self, num_requests: int, seqs_per_request: int = 1) -> Ticket:
        """Counts `num_requests` engine requests of `seqs_per_request` sequences each (n) in, or raises 503/429
        without counting anything. --max-waiting bounds sequences: one request with n = 100 is 100 of them."""
        self.require_ready()
        bound = self.args.max_waiting
        seqs = num_requests * seqs_per_request
        if bound is not None and seqs > bound:  # no retry would ever fit it: the client's to change, not to retry
            raise APIError(400, f"the request makes {seqs} sequences ({num_requests} prompt(s) x n="
                           f"{seqs_per_request}); at most {bound} may wait (--max-waiting)",
                           "n" if seqs_per_request > 1 else "prompt")  # fmt: skip
        if bound is not None and self.waiting + seqs > bound:
            raise APIError(
                429, f"too many sequences are waiting ({self.waiting} + {seqs}, at most {bound}); retry later",
                code="queue_full", headers={"Retry-After": "1"},
            )  # fmt: skip
        self.in_flight += num_requests
        self.waiting += seqs
        return Ticket(self, num_requests, seqs_per_request)


class Ticket:
    """One HTTP request's share of the admission counters; `release` is idempotent and always called."""

    def __init__(self, state: ServerState, num_requests: int, seqs_per_request: int = 1):
        self._state = state
        self._unstarted = set(range(num_requests))
        self._count = num_requests
        self._seqs = seqs_per_request
        self._released = False

    def started(self, i: int) -> None:
        """Engine request `i` got its first token: its sequences no longer count as waiting."""
        if i in self._unstarted:
            self._unstarted.discard(i)
            self._state.waiting -= self._seqs

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self._state.waiting -= len(self._unstarted) * self._seqs
        self._unstarted.clear()
        self._state.in_flight -= self._count
