"""What every API response carries, whichever route or error handler made it (an ASGI middleware).

- A limited key's `x-ratelimit-*` headers (deployment.md: every response of a limited key carries them): the
  completions routes set them from their reservation, the rate limiter on its 429s; this adds them elsewhere (a 400,
  a queue_full 429, /v1/models).
- The client's `X-Request-Id` back, on error responses too, so a refused request can be found in the access log.
- The access-log line of a request that would leave none: an API route that answered without an admission (the
  completions routes log through theirs) or an error (the error handler logs those). Probes and /metrics are not
  logged: load balancers and Prometheus call them every few seconds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

if TYPE_CHECKING:
    from jaxinfer.server.context import ServingContext

_UNLOGGED = ("/health", "/version", "/metrics")


class EdgeHeaders:
    def __init__(self, app: ASGIApp, ctx: ServingContext):
        self.app, self.ctx = app, ctx

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                self._on_start(scope, message)
            await send(message)

        await self.app(scope, receive, sending)

    def _on_start(self, scope: Scope, message: Message) -> None:
        headers = MutableHeaders(scope=message)
        state = scope.get("state", {})
        key = state.get("api_key")
        if key is not None:
            for name, value in self.ctx.limiter.headers(key).items():
                if name not in headers:
                    headers[name] = value
        given = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"x-request-id"), None)
        if given is not None and "x-request-id" not in headers:
            headers["X-Request-Id"] = given
        status, path = message["status"], scope["path"]
        if status < 400 and state.get("admission") is None and path not in _UNLOGGED:
            self.ctx.access_log.write({"id": given, "key_id": key.id if key is not None else None, "endpoint": path,
                                       "status": status, "error": None})  # fmt: skip
