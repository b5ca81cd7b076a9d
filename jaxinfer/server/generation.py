"""One engine request as the handlers see it: the AsyncEngine stream plus metrics, counters and the request log."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from jaxinfer.engine.output import OutputAccumulator
from jaxinfer.engine.stream_queue import SlowReaderError
from jaxinfer.server.errors import APIError
from jaxinfer.server.metrics import Metrics
from jaxinfer.server.state import ServerState, Ticket
from jaxinfer.types import RequestOutput, SamplingParams

log = logging.getLogger("jaxinfer.server.requests")


@dataclass
class EngineRequest:
    request_id: str
    prompt: str | None  # the prompt text when the client sent text (echo, detokenizer context)
    prompt_ids: list[int]
    params: SamplingParams


async def run_request(
    state: ServerState, metrics: Metrics, req: EngineRequest, ticket: Ticket, index: int
) -> AsyncIterator[RequestOutput]:
    """Streams the request's outputs (deltas). Closing the iterator early aborts the request in the engine."""
    # Not require_ready(): a request admitted before a SIGTERM still runs to its end while the server drains.
    engine = state.engine
    assert engine is not None, "run_request before the engine was loaded"
    arrival = last = time.monotonic()
    num_tokens = 0
    reasons: dict[int, str] = {}  # sample index -> finish reason
    try:
        async with aclosing(engine.generate(req.prompt_ids, req.params, req.request_id, req.prompt)) as outputs:
            async for out in outputs:
                reasons.update((c.index, c.finish_reason) for c in out.outputs if c.finish_reason is not None)
                if out.error is not None:  # this request failed in the engine; the others go on
                    raise APIError(500, f"the request failed in the engine: {out.error}", code="engine_error")
                now = time.monotonic()
                tokens = sum(len(c.token_ids) for c in out.outputs)
                if tokens:
                    if num_tokens == 0:
                        ticket.started(index)
                        metrics.ttft.observe(now - arrival)
                        metrics.prompt_tokens.inc(len(req.prompt_ids))
                    else:
                        metrics.itl.observe(now - last)
                    metrics.generation_tokens.inc(tokens)
                    num_tokens, last = num_tokens + tokens, now
                yield out
    except SlowReaderError as e:  # the client stopped reading: its request is aborted, its stream says so in-band
        raise APIError(408, str(e), code="client_stopped_reading") from e
    except Exception as e:
        if engine.alive or isinstance(e, APIError):
            raise
        # AsyncEngine raises its EngineDeadError to every waiting caller when its thread dies.
        raise APIError(503, f"the engine stopped: {e}", code="engine_dead") from e
    finally:
        latency = time.monotonic() - arrival
        metrics.e2e.observe(latency)
        finish = [reasons.get(i, "abort") for i in range(req.params.n)]
        for reason in finish:
            metrics.request_success.labels(reason).inc()
        log.info(
            "%s: prompt_tokens=%d completion_tokens=%d latency=%.3fs finish_reason=%s",
            req.request_id, len(req.prompt_ids), num_tokens, latency, ",".join(finish),
        )  # fmt: skip


async def final_output(state: ServerState, metrics: Metrics, req: EngineRequest, ticket: Ticket, index: int):
    """The request's whole output, once it finished."""
    whole = OutputAccumulator()
    async with aclosing(run_request(state, metrics, req, ticket, index)) as outputs:
        async for out in outputs:
            whole.add(out)
    final = whole.result()
    if final is None or not final.finished:
        raise RuntimeError(f"request {req.request_id} ended without a final output")
    return final
