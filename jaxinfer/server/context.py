"""What every handler needs: the flags, the server state, the metrics, and a few lookups over them."""

from __future__ import annotations

import asyncio
import functools
import re
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse

from jaxinfer.server.access_log import AccessLog
from jaxinfer.server.admission import Admission, PromptRecord, RequestRecord
from jaxinfer.server.args import ServerArgs
from jaxinfer.server.errors import APIError
from jaxinfer.server.filters import Filters
from jaxinfer.server.generation import EngineRequest
from jaxinfer.server.keys import APIKey, KeyRing
from jaxinfer.server.logprobs import TokenText
from jaxinfer.server.metrics import Metrics
from jaxinfer.server.output_gate import OutputGate
from jaxinfer.server.ratelimit import RateLimitCollector, RateLimiter
from jaxinfer.server.state import ServerState
from jaxinfer.server.tool_parsers import parser_for
from jaxinfer.server.tracing import RequestTracer
from jaxinfer.tokenizer import Tokenizer
from jaxinfer.types import MAX_SESSION_ID_LEN, SamplingParams

T = TypeVar("T")


@dataclass
class ServingContext:
    args: ServerArgs
    state: ServerState
    metrics: Metrics
    filters: Filters | None = None  # --filters-config
    tracer: RequestTracer | None = None  # --otlp-traces-endpoint
    # From the flags: the API keys (--api-key, --api-keys-file), their limits, the access log.
    keys: KeyRing = field(init=False)
    limiter: RateLimiter = field(init=False)
    access_log: AccessLog = field(init=False)
    _token_text: TokenText | None = field(default=None, init=False)
    created: int = field(default_factory=lambda: int(time.time()))
    _pool: ThreadPoolExecutor | None = field(default=None, init=False)
    _filter_pool: ThreadPoolExecutor | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.keys = KeyRing(self.args.api_key, self.args.api_keys_file)
        self.limiter = RateLimiter(self.keys.keys())
        self.metrics.registry.register(RateLimitCollector(self.limiter))
        self.access_log = AccessLog(self.args.access_log, self.args.access_log_file)

    async def off_loop(self, fn: Callable[..., T], *args, **kwargs) -> T:
        """Runs CPU work (JSON and model validation of large bodies, chat templates, tokenization) on the thread
        pool, so that one big request never stalls the event loop's other streams."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.args.tokenizer_threads, thread_name_prefix="jaxinfer-cpu")
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    async def json_response(self, build: Callable[[], Any], headers: dict[str, str] | None = None) -> JSONResponse:
        """A whole (non-streamed) response, built and serialized on the thread pool: n=128 choices with 20 top
        logprobs a token make tens of MB, whose building on the event loop stalled every other stream for seconds."""
        return await self.off_loop(lambda: JSONResponse(build(), headers=headers))

    async def _off_loop_filtering(self, fn: Callable[..., T], *args) -> T:
        """Output filters on threads of their own: a slow filter delays the choices it checks, not tokenization."""
        if self._filter_pool is None:
            self._filter_pool = ThreadPoolExecutor(self.args.tokenizer_threads, thread_name_prefix="jaxinfer-filter")
        return await asyncio.get_running_loop().run_in_executor(self._filter_pool, functools.partial(fn, *args))

    def close(self) -> None:
        for pool in (self._pool, self._filter_pool):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        self.access_log.close()
        if self.tracer is not None:
            self.tracer.close()

    def reload_keys(self) -> None:
        """SIGHUP: the keys file again (a bad one keeps the keys in use); limits apply from the next request."""
        if self.keys.reload():
            self.limiter.sync(self.keys.keys())

    def admit(
        self, request: Request, request_id: str, model: str, subs: list[EngineRequest], stream: bool
    ) -> Admission:
        """Admits the request's engine requests (n samples each), or raises 429/503 having taken nothing: the key's
        limits first (a request, a slot, prompt + max_tokens x n tokens), then the server's queue bound."""
        key: APIKey | None = getattr(request.state, "api_key", None)
        n = subs[0].params.n
        tokens = sum(len(s.prompt_ids) + s.params.max_tokens * s.params.n for s in subs)
        reservation = self.limiter.reserve(key, tokens)
        try:
            ticket = self.state.admit(len(subs), n)
        except BaseException:
            reservation.cancel()
            raise
        record = RequestRecord(request_id, request.url.path, reservation.key_id, model, stream, time.monotonic(),
                               request.headers.get("traceparent"),
                               [PromptRecord(len(s.prompt_ids), s.params.n) for s in subs])  # fmt: skip
        admission = Admission(ticket, reservation, record, self._ended)
        request.state.admission = admission
        return admission

    def _ended(self, rec: RequestRecord) -> None:
        self.access_log.request(rec)
        if self.tracer is not None:
            self.tracer.record(rec)

    def refused(self, request: Request, status: int, code: str | None) -> None:
        """An error response: in the access log, unless the request was admitted (its own line says how it ended)."""
        if getattr(request.state, "admission", None) is not None:
            return
        key: APIKey | None = getattr(request.state, "api_key", None)
        self.access_log.refused(request.headers.get("x-request-id"), key.id if key else None, request.url.path,
                                status, code)  # fmt: skip

    def check_input(self, text: str, param: str) -> None:
        """A 400 (code content_filter) when an input filter blocks `text`, one prompt or message."""
        reason = self.filters.check_input(text) if self.filters is not None else None
        if reason is not None:
            raise APIError(400, f"{param} was blocked by a content filter ({reason})", param, "content_filter")

    def output_gate(self, prompt_ids: list[int], params: SamplingParams) -> OutputGate | None:
        """What holds a request's generated text until the output filters pass it; None without output filters."""
        if self.filters is None or not self.filters.checks_output:
            return None
        return OutputGate(self.filters, self.tokenizer, prompt_ids, params, self._off_loop_filtering)

    def model_name(self, requested: str | None) -> str:
        """The name to answer with; 404 for a model this server does not serve."""
        names = self.args.model_names
        if requested is None:
            return names[0]
        if requested not in names:
            raise APIError(404, f"The model `{requested}` does not exist.", "model", "model_not_found")
        return requested

    @property
    def tokenizer(self) -> Tokenizer:
        assert self.state.tokenizer is not None, "used before the model was loaded"
        return self.state.tokenizer

    @property
    def tool_parser(self) -> str | None:
        """The format of the model's own tool calls, for tool_choice "auto" (--tool-call-parser; None: none)."""
        return parser_for(self.args.tool_call_parser, self.tokenizer.chat_template)

    @property
    def token_text(self) -> TokenText:
        if self._token_text is None:
            self._token_text = TokenText(self.tokenizer)
        return self._token_text

    @property
    def context_tokens(self) -> int:
        """Most tokens (prompt + output) one sequence can hold: the context length, or the whole KV pool."""
        return min(self.state.max_model_len, self.state.kv_tokens)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


_CLIENT_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


def session_id(request: Request, user: str | None) -> str | None:
    """The conversation whose KV pages the engine keeps between turns: the `X-Session-Id` header, else the
    request's `user` field (OpenAI's end-user id), else none."""
    given = request.headers.get("x-session-id")
    if given is not None:
        if not _CLIENT_ID.match(given):
            raise APIError(400, "X-Session-Id must be 1 to 128 characters of A-Z a-z 0-9 . _ : -", "X-Session-Id")
        return given
    if not user:
        return None
    if len(user) > MAX_SESSION_ID_LEN:
        raise APIError(400, f"user: at most {MAX_SESSION_ID_LEN} characters (it names the session)", "user")
    return user


def request_id(request: Request, prefix: str) -> tuple[str, str]:
    """(the response's id, the prefix of its engine request ids). A client's `X-Request-Id` (vLLM honours it too)
    names the response and starts the engine ids, which stay unique whatever the client sends."""
    given = request.headers.get("x-request-id")
    if given is None:
        rid = new_id(prefix)
        return rid, rid
    if not _CLIENT_ID.match(given):
        raise APIError(400, "X-Request-Id must be 1 to 128 characters of A-Z a-z 0-9 . _ : -", "X-Request-Id")
    return given, f"{given}-{uuid.uuid4().hex[:12]}"
