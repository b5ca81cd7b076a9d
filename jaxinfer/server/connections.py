"""uvicorn's HTTP/1.1 connection, with a deadline on each request's head and its errors in OpenAI's shape.

uvicorn arms no timer on a connection until its first response is sent (from then on its keep-alive timeout closes
it when idle). A client that connects and sends nothing, or sends a request line a byte at a time, holds a socket
and a file descriptor for as long as it likes; a few thousand such exhaust the process's descriptors, and then the
server refuses everyone (slowloris). Here a request's head (request line and headers) must arrive within
HEAD_TIMEOUT_S: from the connection's start for its first request, from the first byte of each later one (an idle
kept-alive connection is uvicorn's to close). Past it the client gets a 408 and the connection closes. The body has
its own deadline (body.BODY_TIMEOUT_S).

uvicorn answers a malformed request (bad syntax, a head over h11's 16 KiB) with a plain-text 400 of its own; here
it is a 400 in OpenAI's shape, as every other error the server returns.
"""

from __future__ import annotations

import asyncio
import logging
from http import HTTPStatus

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from jaxinfer.server.errors import APIError

log = logging.getLogger(__name__)

# How long a request's head may take to arrive: nginx's client_header_timeout is 60 s; a head is a few hundred
# bytes, so a live client needs milliseconds.
HEAD_TIMEOUT_S = 30.0


def _raw_response(error: APIError) -> bytes:
    """A whole HTTP/1.1 response that closes the connection: written past h11, which has no request to answer."""
    body = error.response().body
    head = [f"HTTP/1.1 {error.status} {HTTPStatus(error.status).phrase}", "content-type: application/json",
            f"content-length: {len(body)}", "connection: close"]  # fmt: skip
    return ("\r\n".join(head) + "\r\n\r\n").encode("ascii") + body


class DeadlineH11Protocol(H11Protocol):
    """uvicorn's h11 protocol (pass as `uvicorn.Config(http=...)`), with the head deadline and JSON 400s above."""

    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        if self._head_timer is None and self._awaiting_head():  # the first byte of a later request's head
            self._arm_head_timer()
        super().data_received(data)
        if self._head_timer is not None and not self._awaiting_head():
            self._head_timer.cancel()
            self._head_timer = None

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        self.transport.write(_raw_response(APIError(400, f"invalid HTTP request: {msg}", code="invalid_http")))
        self.transport.close()

    def _awaiting_head(self) -> bool:
        return self.conn.their_state is h11.IDLE

    def _arm_head_timer(self) -> None:
        self._head_timer = self.loop.call_later(HEAD_TIMEOUT_S, self._head_timed_out)

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or not self._awaiting_head():
            return
        log.info("%s: closing a connection whose request head did not arrive within %gs",
                 ":".join(map(str, self.client)) if self.client else "client", HEAD_TIMEOUT_S)  # fmt: skip
        self.transport.write(_raw_response(APIError(408, f"the request head did not arrive within "
                                                         f"{HEAD_TIMEOUT_S:g}s", code="request_timeout")))  # fmt: skip
        self.transport.close()
