"""One stream's queue between an engine front's producer thread and the caller's event loop, with the one
slow-reader cutoff that both fronts (`AsyncEngine` in process, `MPAsyncEngine` over ZeroMQ) use.

A caller that stops taking its outputs (an HTTP client that stopped reading without disconnecting: its response
task waits on the socket) would otherwise hold its KV pages and a growing queue for as long as the connection
lives. It is cut off once `max_buffer` outputs wait for it, or when an output arrives while it has taken nothing
for `stall_timeout` seconds with outputs waiting: `on_cut` aborts its request (its pages return to the pool), what
waits is dropped at once and the caller finds SlowReaderError when it reads again.

Outputs are deltas (output.py): a caller that fell behind takes everything waiting for it at once, merged into
one output, so a reader that is slow but reading catches up in one step instead of one output at a time.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from jaxinfer.engine.output import OutputAccumulator
from jaxinfer.types import RequestOutput

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StreamLimits:
    stall_timeout: float = 60.0  # seconds without a take, with outputs waiting
    max_buffer: int = 1024  # outputs waiting


class SlowReaderError(RuntimeError):
    """The stream's caller stopped taking its outputs: the request was aborted to bound what it holds."""


class StreamQueue:
    """Created and read on the caller's event loop; `put_threadsafe` may be called from any thread."""

    def __init__(self, request_id: str, limits: StreamLimits, on_cut: Callable[[str], None]):
        self.request_id = request_id
        self.limits = limits
        self._on_cut = on_cut
        self._loop = asyncio.get_running_loop()
        self._items: deque[RequestOutput | BaseException] = deque()
        self._ready = asyncio.Event()
        self._last_take = time.monotonic()
        self.cut = False

    def qsize(self) -> int:
        """Outputs waiting for the caller."""
        return len(self._items)

    def put_threadsafe(self, item: RequestOutput | BaseException) -> None:
        try:
            self._loop.call_soon_threadsafe(self._put, item)
        except RuntimeError:  # the caller's event loop is closed: nobody is listening any more
            pass

    async def get(self) -> RequestOutput:
        """Every output waiting, merged into one delta; raises what the producer put instead (an engine error,
        SlowReaderError)."""
        items = self._items
        while not items:
            self._ready.clear()
            await self._ready.wait()
        self._last_take = time.monotonic()
        first = items.popleft()
        if isinstance(first, BaseException):
            raise first
        if not items or isinstance(items[0], BaseException):
            return first
        merged = OutputAccumulator()
        merged.add(first)
        while items and not isinstance(items[0], BaseException):
            merged.add(items.popleft())  # type: ignore[arg-type]
        result = merged.result()
        assert result is not None
        return result

    def _put(self, item: RequestOutput | BaseException) -> None:
        if self.cut:
            return
        items = self._items
        waiting = len(items)
        stalled = waiting > 0 and time.monotonic() - self._last_take > self.limits.stall_timeout
        if isinstance(item, BaseException) or not (waiting >= self.limits.max_buffer or stalled):
            items.append(item)
            self._ready.set()
            return
        self.cut = True
        log.warning("request %s: its client stopped reading (%d outputs waiting); aborting it", self.request_id,
                    waiting)  # fmt: skip
        items.clear()  # what it would never read: dropped now, not when the connection finally closes
        items.append(SlowReaderError(f"request {self.request_id} aborted: its client stopped reading"))
        self._ready.set()
        self._on_cut(self.request_id)
