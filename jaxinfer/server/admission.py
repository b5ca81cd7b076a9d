"""One admitted HTTP request, from admission to its end: its share of the server's counters (`Ticket`), its hold on
its API key's limits (`Reservation`), and the record of how it went that the access log and the trace are made of.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from jaxinfer.server.ratelimit import Reservation
from jaxinfer.server.state import Ticket
from jaxinfer.types import RequestMetrics, RequestOutput


@dataclass
class PromptRecord:
    """One engine request (one prompt, n samples) as the server saw it; times are time.monotonic()."""

    prompt_tokens: int
    n: int
    first_output: float | None = None  # when its first token reached the handler
    last_output: float | None = None
    output_tokens: int = 0
    finish_reasons: list[str | None] = field(default_factory=list)
    metrics: RequestMetrics | None = None  # the engine's timeline, from its latest output

    @property
    def cached_tokens(self) -> int:
        return self.metrics.num_cached_tokens if self.metrics is not None else 0


@dataclass
class RequestRecord:
    request_id: str
    endpoint: str
    key_id: str | None
    model: str
    stream: bool
    admitted: float  # time.monotonic() at admission (after tokenization): the zero of ttft and e2e
    traceparent: str | None = None  # the client's W3C trace context, if it sent one
    prompts: list[PromptRecord] = field(default_factory=list)
    status: int = 200  # 499: the client left; 500/503: the engine failed it
    error: str | None = None
    ended: float | None = None

    @property
    def prompt_tokens(self) -> int:
        return sum(p.prompt_tokens for p in self.prompts)

    @property
    def cached_tokens(self) -> int:
        return sum(p.cached_tokens for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(p.output_tokens for p in self.prompts)

    @property
    def started_tokens(self) -> int:
        """Prompt tokens of the prompts that got a first token (a prompt aborted while queued used none)."""
        return sum(p.prompt_tokens for p in self.prompts if p.first_output is not None)

    @property
    def finish_reasons(self) -> list[str]:
        return [r or "abort" for p in self.prompts for r in (p.finish_reasons or [None] * p.n)]

    @property
    def queue_time(self) -> float | None:
        """The longest any of its prompts waited for its first step."""
        waits = [m.first_scheduled_time - m.arrival_time for p in self.prompts
                 if (m := p.metrics) is not None and m.first_scheduled_time is not None]  # fmt: skip
        return max(waits) if waits else None

    @property
    def ttft(self) -> float | None:
        firsts = [p.first_output for p in self.prompts if p.first_output is not None]
        return min(firsts) - self.admitted if firsts else None

    @property
    def e2e(self) -> float | None:
        return self.ended - self.admitted if self.ended is not None else None


class Admission:
    """What a handler holds for an admitted request. `release` (idempotent, always called: the response's end)
    frees the counters, settles the key's tokens to those used and hands the record to `on_end`."""

    def __init__(self, ticket: Ticket, reservation: Reservation, record: RequestRecord,
                 on_end: Callable[[RequestRecord], None]):  # fmt: skip
        self._ticket, self.reservation, self.record, self._on_end = ticket, reservation, record, on_end
        self._released = False

    def headers(self) -> dict[str, str]:
        """The response's headers: the key's x-ratelimit-* and the request's id (the client's X-Request-Id, or the
        one the server made: the response body's `id`, and the access log's), to find it in the logs."""
        return {**self.reservation.headers(), "X-Request-Id": self.record.request_id}

    def started(self, index: int) -> None:
        """Engine request `index` got its first token."""
        self._ticket.started(index)
        self.record.prompts[index].first_output = time.monotonic()

    def output(self, index: int, out: RequestOutput) -> None:
        p = self.record.prompts[index]
        p.last_output = time.monotonic()
        p.output_tokens = sum(len(c.token_ids) for c in out.outputs)
        p.finish_reasons = [c.finish_reason for c in out.outputs]
        if out.metrics is not None:
            p.metrics = out.metrics

    def failed(self, status: int, code: str | None) -> None:
        self.record.status, self.record.error = status, code

    def left(self) -> None:
        """The client went away before the response's end: nginx's 499, unless a failure was recorded first."""
        if self.record.status == 200:
            self.failed(499, "client_disconnected")

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self._ticket.release()
        rec = self.record
        rec.ended = time.monotonic()
        self.reservation.release(rec.started_tokens, rec.output_tokens)
        self._on_end(rec)
