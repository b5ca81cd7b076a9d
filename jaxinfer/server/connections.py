"""uvicorn's HTTP/1.1 connection, with a deadline on each request's head and its errors in OpenAI's shape.

uvicorn arms no timer on a connection until its first response is sent (from then on its keep-alive timeout closes
it when idle). A client that connects and sends nothing, or sends a request line a byte at a time, holds a socket
and a file descriptor for as long as it likes; a few thousand such exhaust the process's descriptors, and then the
server refuses everyone (slowloris). Here a request's head (request line and headers) must arrive within
HEAD_TIMEOUT_S: from the connection's start for its first request, from the first byte of each later one (an idle
kept-alive connection is uvicorn's to close). Past it the client gets a 408 and the connection closes. The body has
its own deadline (body.BODY_TIMEOUT_S) while the app reads it. A response sent before its request's body was read
(a 404, /health, an early 413) leaves no reader and cancels uvicorn's timer at every byte: the rest of that body
gets LEFTOVER_BODY_S to arrive, from the response, or the connection closes.

Idle kept-alive connections close after KEEP_ALIVE_S, longer than clients and load balancers keep theirs (httpx 5 s,
AWS ALB 60 s), so the client closes first: at uvicorn's 5 s both closed at once, and a request sent at that moment
failed ("Server disconnected without sending a response").

uvicorn answers a malformed request (bad syntax, a head over h11's 16 KiB) with a plain-text 400 of its own; here
it is a 400 in OpenAI's shape, as every other error the server returns.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from http import HTTPStatus

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from jaxinfer.server.errors import APIError

log = logging.getLogger(__name__)

# How long a request's head may take to arrive: nginx's client_header_timeout is 60 s; a head is a few hundred
# bytes, so a live client needs milliseconds.
HEAD_TIMEOUT_S = 30.0
# After a response that did not read its request's body: how long the rest of that body may take.
LEFTOVER_BODY_S = 5.0
KEEP_ALIVE_S = 65.0


def _raw_response(error: APIError) -> bytes:
    """A whole HTTP/1.1 response that closes the connection: written past h11, which has no request to answer."""
    body = error.response().body
    head = [f"HTTP/1.1 {error.status} {HTTPStatus(error.status).phrase}", "content-type: application/json",
            f"content-length: {len(body)}", "connection: close"]  # fmt: skip
    return ("\r\n".join(head) + "\r\n\r\n").encode("ascii") + body


class DeadlineH11Protocol(H11Protocol):
    """uvicorn's h11 protocol (pass as `uvicorn.Config(http=...)`), with the head deadline and JSON 400s above."""

    _head_timer: asyncio.TimerHandle | None = None
    _leftover_timer: asyncio.TimerHandle | None = None
    # Told of each error response this layer sends (status, code): the server's metrics count them. Set on a
    # subclass per app (`with_error_hook`): these answers never reach the app's error handlers.
    on_error: Callable[[int, str], None] | None = None

    @classmethod
    def with_error_hook(cls, on_error: Callable[[int, str], None]) -> type[DeadlineH11Protocol]:
        return type(cls.__name__, (cls,), {"on_error": staticmethod(on_error)})

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._after_events()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.transport.is_closing():
            return
        if self.conn.their_state is h11.SEND_BODY and self._leftover_timer is None:  # answered before the body
            self._leftover_timer = self.loop.call_later(LEFTOVER_BODY_S, self._leftover_timed_out)
        self._after_events()

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._head_timer, self._leftover_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._leftover_timer = None
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            # uvicorn's `msg` is always "Invalid HTTP request received." (h11's reason is not passed on)
            why = "not HTTP/1.1 (a malformed request line, header or chunk, or a head over 16 KiB)"
            self.transport.write(_raw_response(APIError(400, f"invalid HTTP request: {why}", code="invalid_http")))
            self._told(400, "invalid_http")
        # else the request was answered already (bad bytes in a body nobody read): a second response would be one
        # to a request never sent
        self.transport.close()

    def _after_events(self) -> None:
        """The timers for the state h11 is in now: a head being awaited with bytes of it buffered (the first bytes
        of a later request on a kept-alive connection, a pipelined one, one that began in the same write as the end
        of the last body) has its deadline running; one that has arrived has none."""
        if not self._awaiting_head():
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
        elif self._head_timer is None and self.conn.trailing_data[0]:
            self._arm_head_timer()
        if self._leftover_timer is not None and self.conn.their_state is not h11.SEND_BODY:
            self._leftover_timer.cancel()  # the rest of the body came: the connection goes on
            self._leftover_timer = None

    def _awaiting_head(self) -> bool:
        return self.conn.their_state is h11.IDLE

    def _arm_head_timer(self) -> None:
        self._head_timer = self.loop.call_later(HEAD_TIMEOUT_S, self._head_timed_out)

    def _leftover_timed_out(self) -> None:
        self._leftover_timer = None
        if not self.transport.is_closing() and self.conn.their_state is h11.SEND_BODY:
            self.transport.close()  # the response went out whole; nothing is owed on this connection

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or not self._awaiting_head():
            return
        log.debug("%s: closing a connection whose request head did not arrive within %gs",
                 ":".join(map(str, self.client)) if self.client else "client", HEAD_TIMEOUT_S)  # fmt: skip
        self.transport.write(_raw_response(APIError(408, f"the request head did not arrive within "
                                                         f"{HEAD_TIMEOUT_S:g}s", code="request_timeout")))  # fmt: skip
        self.transport.close()
        self._told(408, "request_timeout")

    def _told(self, status: int, code: str) -> None:
        if self.on_error is not None:
            self.on_error(status, code)
