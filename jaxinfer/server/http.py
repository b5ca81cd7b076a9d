"""Runs the app under uvicorn, with a draining shutdown on SIGTERM/SIGINT (SIGHUP reloads the API keys file):

1. stop admitting: /health and new requests answer 503 while the listener stays open (load balancers see the
   server going away instead of refused connections);
2. wait up to --graceful-shutdown-timeout for in-flight requests to finish;
3. let uvicorn close the connections (requests still running are cancelled, which aborts them in the engine);
4. the app's lifespan shuts the AsyncEngine down; the process exits 0.

When the engine process dies, streams in flight end with an error at once, /health and new requests answer 503
for a moment (`_DEAD_ENGINE_LINGER_S`, so probes and clients see why), then the server stops and exits 1 for its
supervisor to restart it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType

import uvicorn
from fastapi import FastAPI

from jaxinfer.server.args import ServerArgs
from jaxinfer.server.connections import KEEP_ALIVE_S, DeadlineH11Protocol
from jaxinfer.server.keys import take_deferred_hangup
from jaxinfer.server.state import Phase, ServerState

log = logging.getLogger(__name__)

# Once draining ends, how long uvicorn waits for responses before cancelling them.
_CANCEL_AFTER_S = 2.0
# After the engine process died: how long the server keeps answering 503 before it exits.
_DEAD_ENGINE_LINGER_S = 2.0


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState, drain_timeout: float,
                 on_hangup: Callable[[], None] | None = None):  # fmt: skip
        """on_hangup: run on the event loop at each SIGHUP (reloading the API keys), when serving from the main
        thread (only there can a signal be caught)."""
        super().__init__(config)
        self.state = state
        self.on_hangup = on_hangup
        self.drain_timeout = drain_timeout
        self._drain_deadline: float | None = None
        self.load_failed = False
        self.engine_died = False
        self._dead_deadline: float | None = None
        state.on_fatal = self._on_load_failure
        state.on_engine_dead = self._on_engine_death
        state.load_on_lifespan = False  # loaded from startup() instead, once the sockets listen

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        if self.on_hangup is not None and threading.current_thread() is threading.main_thread():
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self.on_hangup)
            if take_deferred_hangup():  # one came during start-up (jaxinfer.cli deferred it): reload now
                self.on_hangup()
        await super().startup(sockets)
        if self.started:
            self.state.start_loading()

    def _on_load_failure(self) -> None:  # from the loader thread: only flags, the event loop polls them
        self.load_failed = True
        self.should_exit = True

    def _on_engine_death(self) -> None:  # from the engine's reader thread: only flags, the event loop polls them
        self.engine_died = True

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not uvicorn's: it records the signal and raises it again after shutdown, so the process would die by
        # SIGTERM (exit 143) rather than exit 0 after a clean drain.
        if self._drain_deadline is not None:  # a second signal: stop waiting
            self.should_exit = True
            if sig == signal.SIGINT:
                self.force_exit = True
            return
        log.info("signal %d: draining (up to %.0fs for %d requests)", sig, self.drain_timeout, self.state.in_flight)
        self.state.begin_stopping()
        self._drain_deadline = time.monotonic() + self.drain_timeout

    async def on_tick(self, counter: int) -> bool:
        if self.engine_died and not self.should_exit:
            if self._dead_deadline is None:
                log.error("the engine process died: exiting in %.0fs", _DEAD_ENGINE_LINGER_S)
                self._dead_deadline = time.monotonic() + _DEAD_ENGINE_LINGER_S
            elif time.monotonic() >= self._dead_deadline:
                self.should_exit = True
        if self._drain_deadline is not None and not self.should_exit:
            # Handlers too, not only engine requests: one still reading its body (it will get a 503) was cancelled
            # by uvicorn's shutdown, and its client got uvicorn's plain-text 500.
            if self.state.in_flight == 0 and not self.server_state.tasks:
                log.info("drained: no request in flight")
                self.should_exit = True
            elif time.monotonic() >= self._drain_deadline:
                log.warning("drain timeout: aborting %d in-flight requests", self.state.in_flight)
                # Ended here, they answer 503 shutting_down (a stream: in-band, then [DONE]) within uvicorn's
                # grace period; cancelled by uvicorn after it, they would get its plain-text 500.
                if self.state.engine is not None:
                    self.state.engine.end_all(f"--graceful-shutdown-timeout ({self.drain_timeout:g}s) passed")
                self.state.body_reads.end()  # and those still reading their bodies answer 503 too
                self.should_exit = True
        return await super().on_tick(counter)


def uvicorn_config(app: FastAPI, args: ServerArgs, **overrides) -> uvicorn.Config:
    """uvicorn's settings for `app`: the h11 protocol with a request-head deadline (connections.py), whatever
    protocol uvicorn would pick by itself."""
    ctx = app.state.ctx

    def told(status: int, code: str) -> None:  # a 408 or 400 of the connection layer: no request, no path
        ctx.metrics.http_errors.labels(str(status)).inc()
        ctx.access_log.refused(None, None, None, status, code)

    protocol = DeadlineH11Protocol.with_error_hook(told)
    settings = dict(host=args.host, port=args.port, log_level=args.log_level, http=protocol,
                    timeout_keep_alive=KEEP_ALIVE_S, timeout_graceful_shutdown=_CANCEL_AFTER_S)  # fmt: skip
    return uvicorn.Config(app, **{**settings, **overrides})


def serve(app: FastAPI, args: ServerArgs) -> int:
    """Serves until SIGTERM/SIGINT; returns the process exit code (1 when the model failed to load)."""
    ctx = app.state.ctx
    state: ServerState = ctx.state
    config = uvicorn_config(app, args)
    server = DrainingServer(config, state, args.graceful_shutdown_timeout, on_hangup=ctx.reload_keys)
    server.run()
    if server.load_failed or state.phase is Phase.FAILED:
        log.error("exiting: %s", state.error)
        return 1
    if server.engine_died:
        log.error("exiting: %s", state.engine.error if state.engine is not None else "the engine died")
        return 1
    if state.loading:
        # Stopped while the model loads: the loader thread may be inside XLA, and interpreter finalization under
        # it aborts the process (SIGABRT). Nothing holds state worth cleaning up yet, so leave at once.
        log.info("stopped during model loading")
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0
