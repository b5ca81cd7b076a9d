"""Prometheus metrics (`GET /metrics`), named like vLLM's under a `jaxinfer:` prefix.

Gauges of engine state are read at scrape time: from the engine process's latest stats message, or (engine on a
thread of this process) from plain ints and floats that the engine thread updates (list lengths, allocator
counters): reading them from the HTTP thread is safe, mutating them would not be.
Counters and histograms are updated by the request handlers on the event loop.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from jaxinfer.server.state import Phase, ServerState
from jaxinfer.types import RequestMetrics

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                    80.0, 160.0)  # fmt: skip
_RATE_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.99, 1.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)


# Engine.cache_stats() keys -> gauges: sessions (pinned conversations) and the host KV tier.
_CACHE_GAUGES = (
    ("sessions", "session_count", "Conversations whose KV pages are pinned for their next turn"),
    ("session_pinned_pages", "session_pinned_pages", "KV pages pinned by sessions (a shared page counts once)"),
    ("host_kv_bytes", "host_kv_cache_bytes", "Bytes of KV pages held in the host tier"),
    ("host_kv_capacity_bytes", "host_kv_cache_capacity_bytes", "The host tier's byte cap (0: off)"),
)
# ... and counters (they only grow: exposed as NAME_total, for rate()).
_CACHE_COUNTERS = (
    ("session_hits", "session_hits", "Requests that started on their session's pinned pages"),
    ("session_hit_tokens", "session_hit_tokens", "Prompt tokens reused from sessions' pinned pages"),
    ("host_kv_hits", "host_kv_cache_hits", "KV pages copied back from the host tier instead of recomputed"),
    ("host_kv_spills", "host_kv_cache_spills", "KV pages copied out to the host tier"),
)


class _EngineCollector(Collector):
    def __init__(self, state: ServerState):
        self.state = state

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = self.state
        running = waiting = used = total = 0
        hit_rate = 0.0
        timeline: dict = {}
        cache: dict = {}
        compiles = pending = 0
        if s.engine is not None and hasattr(s.engine, "stats"):  # MPAsyncEngine: what the core last reported
            st = s.engine.stats()
            compiles, pending, cache = st.compiles, st.pending_compiles, st.cache
            running, waiting, used, total, hit_rate = st.running, st.waiting, st.pages_used, st.pages_total, st.hit_rate
            if st.idle_share is not None:
                timeline = {"idle_share": st.idle_share, "device_ms": st.device_ms, "host_ms": st.host_ms}
        elif s.engine is not None:  # AsyncEngine: the Engine itself
            from jaxinfer.engine.core_process import timeline_stats

            engine = s.engine.engine
            running, waiting = len(engine.scheduler.running), len(engine.scheduler.waiting)
            used, total = engine.allocator.num_used, engine.allocator.num_pages
            hit_rate = engine.allocator.hit_rate
            cache = engine.cache_stats()
            timeline = timeline_stats(engine)
            from jaxinfer.engine.core_process import compile_count

            compiles = compile_count()

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"jaxinfer:{name}", doc, value=value)

        ready = s.phase is Phase.READY and s.engine is not None and s.engine.alive
        yield gauge("server_ready", "1 when the model is loaded and the engine runs", float(ready))
        yield gauge("num_requests_running", "Sequences in the running batch", running)
        yield gauge("num_requests_waiting", "Sequences queued for admission to the batch", waiting)
        yield gauge("num_requests_in_flight", "Engine requests admitted by the server and not finished", s.in_flight)
        yield gauge("kv_cache_usage_perc", "Fraction of KV cache pages in use (1 = full)",
                    min(1.0, max(0.0, used / total)) if total else 0.0)  # fmt: skip
        yield gauge("kv_cache_used_pages", "KV cache pages in use", used)
        yield gauge("kv_cache_total_pages", "KV cache pages in the pool", total)
        yield gauge("engine_compilations", "XLA compilations in the engine's process so far (once the pending ones are "
                    "done, serving adds none)", compiles)  # fmt: skip
        yield gauge("engine_pending_compilations", "Step programs a cold start left to compile while the engine is "
                    "idle", pending)  # fmt: skip
        yield gauge("prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / prompt tokens looked up",
                    hit_rate)  # fmt: skip
        for key, name, doc in _CACHE_GAUGES:
            if key in cache:
                yield gauge(name, doc, cache[key])
        for key, name, doc in _CACHE_COUNTERS:
            if key in cache:
                yield CounterMetricFamily(f"jaxinfer:{name}", doc, value=cache[key])
        if timeline:  # --step-timeline
            yield gauge("device_idle_share", "Device idle between steps / (idle + busy), recent steps",
                        timeline["idle_share"])  # fmt: skip
            yield gauge("step_device_ms", "Device busy time per step, recent steps (ms)", timeline["device_ms"])
            yield gauge("step_host_ms", "Host time preparing a step, recent steps (ms)", timeline["host_ms"])


class Metrics:
    """One registry per app, so that several servers (tests) in one process do not collide."""

    def __init__(self, state: ServerState):
        self.registry = CollectorRegistry()
        r = self.registry
        r.register(_EngineCollector(state))
        self.prompt_tokens = Counter("jaxinfer:prompt_tokens", "Prefilled prompt tokens", registry=r)
        self.generation_tokens = Counter("jaxinfer:generation_tokens", "Generated tokens", registry=r)
        self.request_success = Counter(
            "jaxinfer:request_success",
            "Finished sequences (one per choice) by finish reason; abort: the client left or the server stopped",
            ["finished_reason"],
            registry=r,
        )
        self.http_errors = Counter("jaxinfer:http_errors", "Error responses by status", ["status"], registry=r)
        self.ttft = Histogram("jaxinfer:time_to_first_token_seconds", "Arrival to first generated token",
                              buckets=_LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.itl = Histogram("jaxinfer:inter_token_latency_seconds", "Time between consecutive outputs of a request",
                             buckets=_ITL_BUCKETS, registry=r)  # fmt: skip
        self.e2e = Histogram("jaxinfer:e2e_request_latency_seconds", "Arrival to last output",
                             buckets=_LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.queue_time = Histogram("jaxinfer:request_queue_time_seconds", "Handed to the engine to its first step",
                                    buckets=_LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.prefix_hit_rate = Histogram(
            "jaxinfer:request_prefix_cache_hit_rate", "Per request: prompt tokens found in the prefix cache / prompt "
            "tokens", buckets=_RATE_BUCKETS, registry=r,
        )  # fmt: skip
        # Observed for requests whose engine has a host KV tier (it sets Request.num_host_cached_tokens).
        self.host_hit_rate = Histogram(
            "jaxinfer:request_host_cache_hit_rate", "Per request: prompt tokens restored from the host KV tier / "
            "prompt tokens", buckets=_RATE_BUCKETS, registry=r,
        )  # fmt: skip

    def first_token(self, ttft: float, prompt_tokens: int, timeline: RequestMetrics | None) -> None:
        """An engine request's first token: its TTFT, and what the engine reported of its prompt's path."""
        self.ttft.observe(ttft)
        self.prompt_tokens.inc(prompt_tokens)
        if timeline is None or timeline.first_scheduled_time is None:
            return
        self.queue_time.observe(max(0.0, timeline.first_scheduled_time - timeline.arrival_time))
        self.prefix_hit_rate.observe(timeline.num_cached_tokens / prompt_tokens)
        if timeline.num_host_cached_tokens is not None:
            self.host_hit_rate.observe(timeline.num_host_cached_tokens / prompt_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
