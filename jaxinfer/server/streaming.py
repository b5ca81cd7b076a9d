"""Response plumbing: server-sent events, merging several engine streams, and client disconnects.

A client that goes away must abort its engine requests at once so their KV pages return to the pool:
- streaming: Starlette cancels the response task on disconnect; the CancelledError travels through our generator
  into AsyncEngine.generate, whose `finally` aborts. `TrackedStream` also closes the body iterator explicitly in
  every other way a response can end (send failing, server shutdown), so no generator is left for the GC;
- non-streaming: Starlette does not watch for disconnects while a handler runs, so `cancel_on_disconnect` does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing
from typing import TYPE_CHECKING, Any, TypeVar

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

if TYPE_CHECKING:
    from jaxinfer.server.admission import Admission

log = logging.getLogger(__name__)

T = TypeVar("T")

SSE_DONE = "data: [DONE]\n\n"


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


_GIVE_UP_STALLS = 4


class TrackedStream(StreamingResponse):
    """A text/event-stream response that always closes its generator and then releases the request's admission
    (counters, the access log): as a 499 when the client left before the stream's end, a 408 when it stopped
    reading. A client that takes nothing for `stall_timeout` seconds is cut off on the engine's side first (its
    request ends; it finds the in-band error if it reads again); a send that still cannot go out after
    `_GIVE_UP_STALLS` such timeouts (the client's window is full: it stopped reading but keeps the connection) ends
    the response, so its key's request slot and the server's drain do not wait on that client for ever."""

    def __init__(self, content: AsyncIterator[str], admission: Admission, stall_timeout: float):
        headers = {"Cache-Control": "no-cache", **admission.headers()}
        self._content, self._admission, self._complete = content, admission, False
        self._stall_timeout = _GIVE_UP_STALLS * stall_timeout
        super().__init__(self._tracked(), media_type="text/event-stream", headers=headers)

    async def _tracked(self) -> AsyncIterator[str]:
        async for chunk in self._content:
            yield chunk
        self._complete = True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_or_give_up(message: Message) -> None:
            try:
                await asyncio.wait_for(send(message), self._stall_timeout)
            except TimeoutError:
                raise _StoppedReading() from None

        try:
            await super().__call__(scope, receive, send_or_give_up)
        except _StoppedReading:  # returning with the response unfinished: the server closes the connection
            log.warning("%s: the client took no data for %.0fs: closing its stream", self._admission.record.request_id,
                        self._stall_timeout)  # fmt: skip
            self._admission.failed(408, "client_stopped_reading")
        finally:
            try:
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
                await self._content.aclose()  # type: ignore[attr-defined]
            finally:
                if not self._complete:
                    self._admission.left()
                self._admission.release()


class _StoppedReading(Exception):
    """A stream's send waited past the stall timeout."""


class ClientDisconnected(Exception):
    """The client closed the connection before the response was ready."""


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Awaits `work` (the body must have been read already); cancels it if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        raise ClientDisconnected()
    finally:
        for t in (task, watcher):
            t.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)


async def merge(streams: list[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
    """Items of several async iterators as (stream index, item), in arrival order. Closing the merge (or an error
    in one stream) closes every stream."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as only:
            async for item in only:
                yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator[Any]) -> None:
        try:
            async with aclosing(stream) as s:
                async for item in s:
                    queue.put_nowait((i, item, None))
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which re-raises it
            queue.put_nowait((i, None, e))
        finally:
            queue.put_nowait((i, done, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item, error = await queue.get()
            if error is not None:
                raise error
            if item is done:
                remaining -= 1
                continue
            yield i, item
    finally:
        for t in tasks:
            t.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*tasks, return_exceptions=True)


async def gather_all(works: list[Awaitable[T]]) -> list[T]:
    """Like asyncio.gather, but one failure (or our cancellation) cancels the others instead of orphaning them."""
    tasks = [asyncio.ensure_future(w) for w in works]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
