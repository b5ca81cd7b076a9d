"""OpenTelemetry traces of requests (`--otlp-traces-endpoint`, vLLM's flag; `pip install 'jaxinfer[otel]'`).

Each request becomes one trace, built when it ends from the timeline the engine reported with its first token
(`RequestMetrics`) and what the server saw, so that nothing is done per token:

    llm_request                    admission -> response end (joins the client's trace when it sends `traceparent`)
    |- queue                       handed to the engine -> its first step        } per prompt of the request
    |- prefill_chunk (x chunks)    a step that computed part of the prompt       } (jaxinfer.prompt_index)
    |- decode                      first token -> last token
    `- detokenize                  first token -> its text reached the handler; incremental, so it overlaps decode:
                                   jaxinfer.detokenize_seconds is the time actually spent in it

The exporter speaks OTLP over gRPC, or over HTTP with OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf (as vLLM).
Without the flag nothing of opentelemetry is imported: the server works without it installed.
"""

from __future__ import annotations

import os
import time
from typing import Any

from jaxinfer.server.admission import RequestRecord

TRACER_NAME = "jaxinfer.server"
PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"


def otlp_tracer_provider(endpoint: str) -> Any:
    """A TracerProvider exporting in batches to `endpoint`; a RuntimeError saying what to install without otel."""
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as e:
        raise RuntimeError(f"--otlp-traces-endpoint needs OpenTelemetry: pip install 'jaxinfer[otel]' ({e})") from e
    protocol = os.environ.get(PROTOCOL_ENV, "grpc")
    try:
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        elif protocol == "http/protobuf":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # type: ignore[no-redef]
        else:
            raise RuntimeError(f"${PROTOCOL_ENV}: grpc or http/protobuf, got {protocol!r}")
    except ImportError as e:
        raise RuntimeError(f"--otlp-traces-endpoint needs the OTLP exporter: pip install 'jaxinfer[otel]' ({e})") from e
    provider = TracerProvider(resource=Resource.create({"service.name": "jaxinfer"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    return provider


class RequestTracer:
    def __init__(self, provider: Any):
        """provider: an opentelemetry TracerProvider (tests give one with an in-memory exporter)."""
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = provider
        self._tracer = provider.get_tracer(TRACER_NAME)
        self._trace = trace
        self._propagator = TraceContextTextMapPropagator()

    def record(self, rec: RequestRecord) -> None:
        trace = self._trace
        # time.monotonic() -> the epoch nanoseconds spans carry.
        offset = time.time_ns() - time.monotonic_ns()

        def ns(t: float) -> int:
            return int(t * 1e9) + offset

        parent = self._propagator.extract({"traceparent": rec.traceparent}) if rec.traceparent else None
        ended = rec.ended if rec.ended is not None else time.monotonic()
        attrs: dict[str, Any] = {
            "gen_ai.request.id": rec.request_id,
            "gen_ai.response.model": rec.model,
            "gen_ai.usage.prompt_tokens": rec.prompt_tokens,
            "gen_ai.usage.completion_tokens": rec.output_tokens,
            "gen_ai.response.finish_reasons": rec.finish_reasons,
            "http.route": rec.endpoint,
            "http.response.status_code": rec.status,
            "jaxinfer.cached_tokens": rec.cached_tokens,
            "jaxinfer.stream": rec.stream,
        }
        if rec.key_id is not None:
            attrs["jaxinfer.key_id"] = rec.key_id
        latencies = {"time_in_queue": rec.queue_time, "time_to_first_token": rec.ttft, "e2e": rec.e2e}
        for name, value in latencies.items():
            if value is not None:
                attrs[f"gen_ai.latency.{name}"] = value
        root = self._tracer.start_span("llm_request", context=parent, kind=trace.SpanKind.SERVER,
                                       start_time=ns(rec.admitted), attributes=attrs)  # fmt: skip
        inside = trace.set_span_in_context(root)

        def span(name: str, start: float, end: float, **extra: Any) -> None:
            s = self._tracer.start_span(name, context=inside, start_time=ns(start), attributes=extra)
            s.end(end_time=ns(max(start, end)))

        for i, p in enumerate(rec.prompts):
            m = p.metrics
            if m is None:  # it never reached the engine's first step
                continue
            if m.first_scheduled_time is not None:
                span("queue", m.arrival_time, m.first_scheduled_time, **{"jaxinfer.prompt_index": i})
            for j, (start, done, tokens) in enumerate(m.prefill_chunks):
                span("prefill_chunk", start, done, **{"jaxinfer.prompt_index": i, "jaxinfer.chunk_index": j,
                                                      "jaxinfer.prompt_tokens": tokens})  # fmt: skip
            if m.first_token_time is not None:
                last = m.finished_time if m.finished_time is not None else ended
                span("decode", m.first_token_time, last,
                     **{"jaxinfer.prompt_index": i, "gen_ai.usage.completion_tokens": p.output_tokens})  # fmt: skip
                span("detokenize", m.first_token_time, p.last_output if p.last_output is not None else ended,
                     **{"jaxinfer.prompt_index": i, "jaxinfer.detokenize_seconds": m.detokenize_s})  # fmt: skip
        if rec.status >= 500:
            root.set_status(trace.Status(trace.StatusCode.ERROR, rec.error or str(rec.status)))
        root.end(end_time=ns(ended))

    def close(self) -> None:
        shutdown = getattr(self.provider, "shutdown", None)
        if shutdown is not None:
            shutdown()  # flushes the batch exporter
