"""One engine request as the handlers see it: the AsyncEngine stream plus metrics, and what it reports to its
request's `Admission` (counters, the access log and trace record)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING

from jaxinfer.engine.async_engine import RequestsEndedError
from jaxinfer.engine.output import OutputAccumulator
from jaxinfer.engine.stream_queue import SlowReaderError
from jaxinfer.server.errors import APIError
from jaxinfer.server.metrics import Metrics
from jaxinfer.server.output_gate import OutputGate
from jaxinfer.server.state import ServerState
from jaxinfer.server.truncation import Truncation, usage_fields
from jaxinfer.types import RequestOutput, SamplingParams

if TYPE_CHECKING:
    from jaxinfer.server.admission import Admission


@dataclass
class EngineRequest:
    request_id: str
    prompt: str | None  # the prompt text when the client sent text (echo, detokenizer context)
    prompt_ids: list[int]
    params: SamplingParams
    truncation: Truncation | None = None  # what the context-window rule dropped, when the request asked for it
    gate: OutputGate | None = None  # the output filters (--filters-config)
    scoring_only: bool = False  # echo with max_tokens 0: the one token the engine makes is neither shown nor counted


def scored_only(out: RequestOutput) -> RequestOutput:
    """echo with max_tokens 0: the one token the engine made while scoring the prompt is not part of the output,
    nor is how it would have ended the choice (a stop string or stop token it made): the choice ends at its length
    limit, as vLLM's does. What the response, the access log and the key's token count see."""
    outs = [dataclasses.replace(c, text="", token_ids=[], logprobs=[] if c.logprobs is not None else None,
                                cumulative_logprob=None, stop_reason=None,
                                finish_reason="length" if c.finish_reason == "stop" else c.finish_reason)
            for c in out.outputs]  # fmt: skip
    return dataclasses.replace(out, outputs=outs)


def usage(subs: list[EngineRequest], completion_tokens: int, outs: list[RequestOutput | None]) -> dict:
    """OpenAI's usage object for these engine requests. cached_tokens: the prompt tokens found in the prefix cache,
    as the engine reported them with each request's first token; what truncation dropped, when it was asked for."""
    prompt_tokens = sum(len(s.prompt_ids) for s in subs)
    cached = sum(o.metrics.num_cached_tokens for o in outs if o is not None and o.metrics is not None)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
        **usage_fields([s.truncation for s in subs]),
    }


async def run_request(
    state: ServerState, metrics: Metrics, req: EngineRequest, admission: Admission, index: int
) -> AsyncIterator[RequestOutput]:
    """Streams the request's cumulative outputs. Closing the iterator early aborts the request in the engine.

    The engine streams deltas (bounded per step, and merged when this reader falls behind); they add up here into
    the whole output so far, which the output filters, the admission record and the handlers work on."""
    # Not require_ready(): a request admitted before a SIGTERM still runs to its end while the server drains.
    engine = state.engine
    assert engine is not None, "run_request before the engine was loaded"
    arrival = last = time.monotonic()
    num_tokens = 0
    final: RequestOutput | None = None
    whole = OutputAccumulator(req.params)
    try:
        async with aclosing(engine.generate(req.prompt_ids, req.params, req.request_id, req.prompt)) as outputs:
            async for delta in outputs:
                whole.add(delta)
                out = whole.result()
                assert out is not None
                if out.error is not None:  # this request failed in the engine; the others go on
                    final = out
                    admission.output(index, out)
                    raise APIError(500, f"the request failed in the engine: {out.error}", code="engine_error")
                now = time.monotonic()
                tokens = sum(len(c.token_ids) for c in out.outputs)
                if tokens > num_tokens:
                    if num_tokens == 0:
                        admission.started(index)
                        metrics.first_token(now - arrival, len(req.prompt_ids), out.metrics)
                    else:
                        # A merged delta (this reader fell behind) spans several steps: the gap is spread over
                        # them, one observation each, as if they had come one by one.
                        steps = max(len(c.token_ids) for c in delta.outputs)
                        for _ in range(steps):
                            metrics.itl.observe((now - last) / steps)
                    if not req.scoring_only:
                        metrics.generation_tokens.inc(tokens - num_tokens)
                    num_tokens, last = tokens, now
                ended = out.finished
                if req.gate is not None:
                    out = await req.gate.screen(out)
                if req.scoring_only:  # what the response, the access log and the key's count see
                    out = scored_only(out)
                admission.output(index, out)
                if out.finished:
                    final = out
                yield out
                if out.finished and not ended:
                    return  # content filters ended every choice: leaving aborts the rest in the engine
    except SlowReaderError as e:  # the client stopped reading: its request is aborted, its stream says so in-band
        admission.failed(408, "client_stopped_reading")
        raise APIError(408, str(e), code="client_stopped_reading") from e
    except Exception as e:
        if isinstance(e, APIError):
            admission.failed(e.status, e.code)
            raise
        if isinstance(e, RequestsEndedError):  # the drain timeout ended it: the server is going away
            admission.failed(503, "shutting_down")
            raise APIError(503, f"the server shut down before the request finished: {e}", code="shutting_down") from e
        if engine.alive:
            admission.failed(500, type(e).__name__)
            raise
        # AsyncEngine raises its EngineDeadError to every waiting caller when its thread dies.
        admission.failed(503, "engine_dead")
        raise APIError(503, f"the engine stopped: {e}", code="engine_dead") from e
    finally:
        metrics.e2e.observe(time.monotonic() - arrival)
        reasons = [c.finish_reason or "abort" for c in final.outputs] if final else ["abort"] * req.params.n
        for reason in reasons:
            metrics.request_success.labels(reason).inc()


async def final_output(state: ServerState, metrics: Metrics, req: EngineRequest, admission: Admission, index: int):
    """The request's last (finished) output."""
    last = None
    async with aclosing(run_request(state, metrics, req, admission, index)) as outputs:
        async for out in outputs:
            last = out
    if last is None or not last.finished:
        raise RuntimeError(f"request {req.request_id} ended without a final output")
    return last
