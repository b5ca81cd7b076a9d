"""Per-key limits (requests per minute, tokens per minute, requests in flight) as token buckets, OpenAI's rate-limit
headers, and the per-key usage /metrics shows.

A minute's limit is a bucket holding that many units that refills continuously (limit / 60 per second), so a key
may burst up to its limit and then goes on at its steady rate. A request takes one unit of its key's request bucket
and reserves prompt + max_tokens (x n) of its token bucket at admission; when it ends, what it did not use is given
back (`Reservation.release`): the bucket settles to the tokens actually used, and a request that never got a first
token costs no tokens. Everything here runs on the event loop (handlers and /metrics), so it needs no lock.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from jaxinfer.server.errors import APIError
from jaxinfer.server.keys import APIKey


class TokenBucket:
    def __init__(self, per_minute: int, now: float):
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        self.level = self.capacity
        self._t = now

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + max(0.0, now - self._t) * self.rate)
        self._t = now

    def wait(self, cost: float, now: float) -> float:
        """Seconds until `cost` fits (0: now; inf: never, it exceeds the capacity)."""
        self.refill(now)
        if cost > self.capacity:
            return math.inf
        return max(0.0, (cost - self.level) / self.rate)

    def add(self, amount: float, now: float) -> None:
        """Takes (amount < 0) or gives back (amount > 0); the level may go below 0 (a debt) but never above full."""
        self.refill(now)
        self.level = min(self.capacity, self.level + amount)

    def remaining(self, now: float) -> int:
        self.refill(now)
        return max(0, math.floor(self.level))

    def reset_s(self, now: float) -> float:
        """Seconds until the bucket is full again."""
        self.refill(now)
        return (self.capacity - self.level) / self.rate

    def resized(self, per_minute: int, now: float) -> TokenBucket:
        """The bucket under a new limit: what was used (and not refilled yet) stays used."""
        self.refill(now)
        new = TokenBucket(per_minute, now)
        new.level = new.capacity - (self.capacity - self.level)
        return new


def duration(seconds: float) -> str:
    """OpenAI's x-ratelimit-reset-* format (Go durations): 20ms, 1s, 6m0s, 1h2m3.5s."""
    ms = math.ceil(seconds * 1000)
    if ms < 1000:
        return f"{ms}ms"
    h, rest = divmod(ms, 3_600_000)
    m, rest = divmod(rest, 60_000)
    s = f"{rest / 1000:.3f}".rstrip("0").rstrip(".")
    return (f"{h}h" if h else "") + (f"{m}m" if h or m else "") + f"{s}s"


@dataclass
class KeyUsage:
    """One key id's buckets, requests in flight and counters (kept across reloads, as Prometheus counters must)."""

    key: APIKey
    requests: TokenBucket | None
    tokens: TokenBucket | None
    active: bool = True  # in the key file now
    in_flight: int = 0
    admitted: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    rejected: dict[str, int] = field(default_factory=lambda: {"rpm": 0, "tpm": 0, "max_concurrent": 0})

    def headers(self, now: float) -> dict[str, str]:
        """OpenAI's x-ratelimit-* headers for the limits this key has."""
        h = {}
        for kind, bucket in (("requests", self.requests), ("tokens", self.tokens)):
            if bucket is not None:
                h[f"x-ratelimit-limit-{kind}"] = str(int(bucket.capacity))
                h[f"x-ratelimit-remaining-{kind}"] = str(bucket.remaining(now))
                h[f"x-ratelimit-reset-{kind}"] = duration(bucket.reset_s(now))
        return h


class Reservation:
    """One HTTP request's hold on its key: a request slot, a unit of the request bucket, reserved tokens.
    `release` (idempotent, always called) settles the tokens to what was used and frees the slot."""

    def __init__(self, limiter: RateLimiter, usage: KeyUsage | None, tokens: int):
        self._limiter, self.usage, self.reserved = limiter, usage, tokens
        self.released = False

    @property
    def key_id(self) -> str | None:
        return self.usage.key.id if self.usage is not None else None

    def headers(self) -> dict[str, str]:
        return self.usage.headers(self._limiter.clock()) if self.usage is not None else {}

    def release(self, prompt_tokens: int, completion_tokens: int) -> None:
        if self.released:
            return
        self.released = True
        u = self.usage
        if u is None:
            return
        u.in_flight -= 1
        u.prompt_tokens += prompt_tokens
        u.completion_tokens += completion_tokens
        if u.tokens is not None:
            u.tokens.add(self.reserved - (prompt_tokens + completion_tokens), self._limiter.clock())

    def cancel(self) -> None:
        """Admission failed after the reservation (the queue is full): nothing was used, not even the request."""
        if self.released or self.usage is None:
            self.released = True
            return
        self.release(0, 0)
        self.usage.admitted -= 1
        if self.usage.requests is not None:
            self.usage.requests.add(1, self._limiter.clock())


class RateLimiter:
    def __init__(self, keys: list[APIKey], clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._usage: dict[str, KeyUsage] = {}
        self.sync(keys)

    def sync(self, keys: list[APIKey]) -> None:
        """Takes the keys (and limits) now in use; buckets of unchanged limits keep their levels."""
        now = self.clock()
        current = {k.id for k in keys}
        for u in self._usage.values():
            u.active = u.key.id in current
        for k in keys:
            u = self._usage.get(k.id)
            if u is None:
                self._usage[k.id] = KeyUsage(k, *(TokenBucket(v, now) if v else None for v in (k.rpm, k.tpm)))
                continue
            u.requests = _resize(u.requests, k.rpm, now)
            u.tokens = _resize(u.tokens, k.tpm, now)
            u.key, u.active = k, True

    def usage(self) -> list[KeyUsage]:
        return list(self._usage.values())

    def headers(self, key: APIKey) -> dict[str, str]:
        """The key's x-ratelimit-* headers now ({} for a key without limits)."""
        u = self._usage.get(key.id)
        return u.headers(self.clock()) if u is not None else {}

    def reserve(self, key: APIKey | None, tokens: int) -> Reservation:
        """Takes a request slot, one request and `tokens` for `key`, or raises a 429 (taking nothing)."""
        if key is None:
            return Reservation(self, None, 0)
        u = self._usage[key.id]
        now = self.clock()
        if key.max_concurrent is not None and u.in_flight >= key.max_concurrent:
            raise self._reject(u, "max_concurrent", f"{u.in_flight} requests in flight, at most {key.max_concurrent}",
                               "requests", 1.0)  # fmt: skip
        if u.requests is not None and (wait := u.requests.wait(1, now)) > 0:
            raise self._reject(u, "rpm", f"requests per min (RPM): Limit {key.rpm}, Requested 1", "requests", wait)
        if u.tokens is not None and (wait := u.tokens.wait(tokens, now)) > 0:
            if math.isinf(wait):  # waiting cannot help: no Retry-After
                what = f"Request too large for tokens per min (TPM): Limit {key.tpm}, Requested {tokens} (prompt + "
                raise self._reject(u, "tpm", what + "max_tokens); lower max_tokens or the prompt", "tokens", None)
            what = f"tokens per min (TPM): Limit {key.tpm}, Remaining {u.tokens.remaining(now)}, Requested {tokens}"
            raise self._reject(u, "tpm", what + " (prompt + max_tokens)", "tokens", wait)
        if u.requests is not None:
            u.requests.add(-1, now)
        if u.tokens is not None:
            u.tokens.add(-tokens, now)
        u.in_flight += 1
        u.admitted += 1
        return Reservation(self, u, tokens)

    def _reject(self, u: KeyUsage, limit: str, what: str, err_type: str, wait: float | None) -> APIError:
        u.rejected[limit] += 1
        headers = u.headers(self.clock())
        message = f"Rate limit reached for key {u.key.id!r} on {what}."
        if wait is not None:
            # Retry-After in whole seconds (RFC 9110), rounded up; retry-after-ms, which OpenAI's clients read first.
            headers["retry-after"] = str(max(1, math.ceil(wait)))
            headers["retry-after-ms"] = str(max(1, math.ceil(wait * 1000)))
            message += f" Please try again in {duration(wait)}."
        return APIError(429, message, code="rate_limit_exceeded", err_type=err_type, headers=headers)


def _resize(bucket: TokenBucket | None, limit: int | None, now: float) -> TokenBucket | None:
    if limit is None:
        return None
    if bucket is None:
        return TokenBucket(limit, now)
    return bucket if bucket.capacity == limit else bucket.resized(limit, now)


class RateLimitCollector(Collector):
    """Per key id on /metrics: its limits, what is left of them, requests in flight, admitted and rate-limited
    requests, and the tokens its finished requests used."""

    def __init__(self, limiter: RateLimiter):
        self.limiter = limiter

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        now = self.limiter.clock()
        limit = GaugeMetricFamily("jaxinfer:api_key_limit", "The key's limit (absent: none)",
                                  labels=["key_id", "limit"])  # fmt: skip
        remaining = GaugeMetricFamily("jaxinfer:api_key_remaining", "What the key may still use now, per limit",
                                      labels=["key_id", "limit"])  # fmt: skip
        in_flight = GaugeMetricFamily("jaxinfer:api_key_requests_in_flight", "The key's requests being served",
                                      labels=["key_id"])  # fmt: skip
        admitted = CounterMetricFamily("jaxinfer:api_key_requests", "Requests admitted for the key", labels=["key_id"])
        rejected = CounterMetricFamily("jaxinfer:api_key_rate_limited", "Requests refused (429) by the key's limits",
                                       labels=["key_id", "limit"])  # fmt: skip
        tokens = CounterMetricFamily("jaxinfer:api_key_tokens", "Tokens the key's finished requests used (settled)",
                                     labels=["key_id", "kind"])  # fmt: skip
        for u in self.limiter.usage():
            kid = u.key.id
            if u.active:
                for name, value, bucket in (("rpm", u.key.rpm, u.requests), ("tpm", u.key.tpm, u.tokens)):
                    if value is not None and bucket is not None:
                        limit.add_metric([kid, name], value)
                        remaining.add_metric([kid, name], bucket.remaining(now))
                if u.key.max_concurrent is not None:
                    limit.add_metric([kid, "max_concurrent"], u.key.max_concurrent)
                    remaining.add_metric([kid, "max_concurrent"], max(0, u.key.max_concurrent - u.in_flight))
            in_flight.add_metric([kid], u.in_flight)
            admitted.add_metric([kid], u.admitted)
            for name, count in u.rejected.items():
                rejected.add_metric([kid, name], count)
            tokens.add_metric([kid, "prompt"], u.prompt_tokens)
            tokens.add_metric([kid, "completion"], u.completion_tokens)
        yield from (limit, remaining, in_flight, admitted, rejected, tokens)
