"""One engine request as the handlers see it: the AsyncEngine stream plus metrics, counters and the request log."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from jaxinfer.server.errors import APIError
from jaxinfer.server.metrics import Metrics
from jaxinfer.server.output_gate import OutputGate
from jaxinfer.server.state import ServerState, Ticket
from jaxinfer.server.truncation import Truncation
from jaxinfer.types import RequestOutput, SamplingParams

log = logging.getLogger("jaxinfer.server.requests")


@dataclass
class EngineRequest:
    request_id: str
    prompt: str | None  # the prompt text when the client sent text (echo, detokenizer context)
    prompt_ids: list[int]
    params: SamplingParams
    truncation: Truncation | None = None  # what the context-window rule dropped, when the request asked for it
    gate: OutputGate | None = None  # the output filters (--filters-config)


async def run_request(
    state: ServerState, metrics: Metrics, req: EngineRequest, ticket: Ticket, index: int
) -> AsyncIterator[RequestOutput]:
    """Streams the request's cumulative outputs. Closing the iterator early aborts the request in the engine."""
    # Not require_ready(): a request admitted before a SIGTERM still runs to its end while the server drains.
    engine = state.engine
    assert engine is not None, "run_request before the engine was loaded"
    arrival = last = time.monotonic()
    num_tokens = 0
    final: RequestOutput | None = None
    try:
        async with aclosing(engine.generate(req.prompt_ids, req.params, req.request_id, req.prompt)) as outputs:
            async for out in outputs:
                if out.error is not None:  # this request failed in the engine; the others go on
                    final = out
                    raise APIError(500, f"the request failed in the engine: {out.error}", code="engine_error")
                now = time.monotonic()
                tokens = sum(len(c.token_ids) for c in out.outputs)
                if tokens > num_tokens:
                    if num_tokens == 0:
                        ticket.started(index)
                        metrics.ttft.observe(now - arrival)
                        metrics.prompt_tokens.inc(len(req.prompt_ids))
                    else:
                        metrics.itl.observe(now - last)
                    metrics.generation_tokens.inc(tokens - num_tokens)
                    num_tokens, last = tokens, now
                ended = out.finished
                if req.gate is not None:
                    out = await req.gate.screen(out)
                if out.finished:
                    final = out
                yield out
                if out.finished and not ended:
                    return  # content filters ended every choice: leaving aborts the rest in the engine
    except Exception as e:
        if engine.alive or isinstance(e, APIError):
            raise
        # AsyncEngine raises its EngineDeadError to every waiting caller when its thread dies.
        raise APIError(503, f"the engine stopped: {e}", code="engine_dead") from e
    finally:
        latency = time.monotonic() - arrival
        metrics.e2e.observe(latency)
        reasons = [c.finish_reason or "abort" for c in final.outputs] if final else ["abort"] * req.params.n
        for reason in reasons:
            metrics.request_success.labels(reason).inc()
        log.info(
            "%s: prompt_tokens=%d completion_tokens=%d latency=%.3fs finish_reason=%s",
            req.request_id, len(req.prompt_ids), num_tokens, latency, ",".join(reasons),
        )  # fmt: skip


async def final_output(state: ServerState, metrics: Metrics, req: EngineRequest, ticket: Ticket, index: int):
    """The request's last (finished) output."""
    last = None
    async with aclosing(run_request(state, metrics, req, ticket, index)) as outputs:
        async for out in outputs:
            last = out
    if last is None or not last.finished:
        raise RuntimeError(f"request {req.request_id} ended without a final output")
    return last
