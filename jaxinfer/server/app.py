"""The FastAPI application: routes, API-key check, error shape, and the model loading in the background."""

from __future__ import annotations

import importlib.metadata
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.datastructures import Headers

from jaxinfer.server.args import ServerArgs
from jaxinfer.server.chat import create_chat_completion
from jaxinfer.server.completions import create_completion
from jaxinfer.server.context import ServingContext
from jaxinfer.server.edge import EdgeHeaders
from jaxinfer.server.errors import APIError, install_handlers
from jaxinfer.server.filters import load_filters
from jaxinfer.server.metrics import Metrics
from jaxinfer.server.state import Loader, ServerState
from jaxinfer.server.tokenize import detokenize, tokenize
from jaxinfer.server.tokenizer_info import router as tokenizer_info_router
from jaxinfer.server.tracing import RequestTracer, otlp_tracer_provider

if TYPE_CHECKING:
    from jaxinfer.engine.mp_engine import MPAsyncEngine


def _context(request: Request) -> ServingContext:
    return request.app.state.ctx


def _require_api_key(request: Request) -> None:
    """The key (`Authorization: Bearer KEY`) goes on request.state.api_key for the limits and the logs."""
    keys = _context(request).keys
    if not keys.enabled:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    key = keys.lookup(token.strip()) if scheme.lower() == "bearer" else None  # constant time: see KeyRing
    if key is None:
        raise APIError(401, "Incorrect or missing API key: send `Authorization: Bearer KEY`", code="invalid_api_key")
    request.state.api_key = key


def _version() -> str:
    try:
        return importlib.metadata.version("jaxinfer")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


def _open_routes() -> APIRouter:
    """Probes and monitoring: no API key, as load balancers and Prometheus bring none."""
    router = APIRouter()

    # HEAD too: load balancers' and uptime checkers' probes often send it.
    @router.api_route("/health", methods=["GET", "HEAD"])
    async def health(request: Request) -> Response:
        err = _context(request).state.unavailable()
        return err.response() if err else JSONResponse({"status": "ok"})

    @router.api_route("/version", methods=["GET", "HEAD"])
    async def version() -> JSONResponse:
        return JSONResponse({"version": _version()})

    @router.get("/metrics")
    async def metrics(request: Request) -> Response:
        # Answers while starting too (jaxinfer:server_ready 0), so a scrape shows the server coming up.
        return Response(_context(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return router


def _api_routes() -> APIRouter:
    router = APIRouter(dependencies=[Depends(_require_api_key)])

    def card(ctx: ServingContext, name: str) -> dict:
        return {
            "id": name,
            "object": "model",
            "created": ctx.created,
            "owned_by": "jaxinfer",
            "root": ctx.args.model,
            "parent": None,
            "max_model_len": ctx.context_tokens,  # what a request may use: less than the setting when the pool is
        }  # fmt: skip

    @router.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        ctx = _context(request)
        ctx.state.require_ready()
        return JSONResponse({"object": "list", "data": [card(ctx, name) for name in ctx.args.model_names]})

    @router.get("/v1/models/{model_id:path}")  # path: served names may hold slashes ("org/model")
    async def model(request: Request, model_id: str) -> JSONResponse:
        ctx = _context(request)
        ctx.state.require_ready()
        if model_id not in ctx.args.model_names:
            raise APIError(404, f"The model `{model_id}` does not exist.", "model", "model_not_found")
        return JSONResponse(card(ctx, model_id))

    @router.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await create_completion(_context(request), request)

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await create_chat_completion(_context(request), request)

    @router.post("/tokenize")
    async def tokenize_route(request: Request) -> Response:
        return await tokenize(_context(request), request)

    @router.post("/detokenize")
    async def detokenize_route(request: Request) -> Response:
        return await detokenize(_context(request), request)

    return router


class _CORS(CORSMiddleware):
    """Starlette's CORS, whose refused preflight (an origin --allowed-origins does not list) is an error in
    OpenAI's shape like every other answer, not its plain text."""

    def preflight_response(self, request_headers: Headers) -> Response:
        answer = super().preflight_response(request_headers)
        if answer.status_code != 400:
            return answer
        refused = APIError(400, f"{answer.body.decode()} for this server (--allowed-origins)", code="cors_refused")
        response = refused.response()
        response.headers.update({k: v for k, v in answer.headers.items() if k.lower().startswith("access-control-")})
        return response


def build_app(
    args: ServerArgs, loader: Loader | None = None, tracer_provider: Any = None, engine: MPAsyncEngine | None = None
) -> FastAPI:
    """The app. The model loads (`loader`, in this process; default: the real engine, in its own process unless
    --no-engine-process) on a background thread once the server starts: under `jaxinfer.server.http.serve` once
    it listens, under any other ASGI server at lifespan start-up. Raises KeyFileError for a bad --api-keys-file.
    tracer_provider: an OpenTelemetry TracerProvider for request traces (default: --otlp-traces-endpoint's).
    engine: the engine's process (an MPAsyncEngine), started already."""
    state = ServerState(args, loader, engine)
    if tracer_provider is None and args.otlp_traces_endpoint:
        tracer_provider = otlp_tracer_provider(args.otlp_traces_endpoint)
    ctx = ServingContext(
        args, state, Metrics(state),
        filters=load_filters(args.filters_config) if args.filters_config else None,
        tracer=RequestTracer(tracer_provider) if tracer_provider is not None else None,
    )  # fmt: skip

    def on_error(request: Request, exc: APIError) -> None:
        ctx.metrics.http_errors.labels(str(exc.status)).inc()
        ctx.refused(request, exc.status, exc.code)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if state.load_on_lifespan:
            state.start_loading()
        yield
        state.shutdown()
        ctx.close()

    app = FastAPI(title="jaxinfer", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.ctx = ctx
    install_handlers(app, on_error=on_error)
    app.add_middleware(EdgeHeaders, ctx=ctx)  # inside CORS, which answers preflights before any route
    if args.allowed_origins:  # browsers' preflight (OPTIONS) and CORS headers, before the API-key check
        app.add_middleware(_CORS, allow_origins=args.allowed_origins, allow_methods=["*"],
                           allow_headers=["*"])  # fmt: skip
    app.include_router(_open_routes())
    app.include_router(_api_routes())
    app.include_router(tokenizer_info_router(), dependencies=[Depends(_require_api_key)])
    return app
