"""Conversations that keep their KV: a finished turn's pages stay pinned under its session id. Never imports jax.

When a request with a `session_id` ends (stop or length; n == 1), the store takes its own reference on the
request's pages and remembers the tokens whose K/V they hold. The next request with that id starts on them: the
longest common prefix of its prompt and the remembered tokens is reused, token by token, so the new turn prefills
only the new message (plus the last sampled token of the previous turn, whose K/V was never computed).

Full pages are shared (ref counts: the prefix cache may hold them too). The page where the new prompt parts from
the remembered tokens (the session's partly filled last page, or a full page where a re-rendered reply tokenizes
differently) is handed over to the new turn, which overwrites the rest of it. That is only safe for a page no one
else holds: a full page is then taken out of the prefix cache first; a page someone else holds ends the match at
its start. So a session is consumed by the request that starts on it, and pinned again when that request ends.

Pins are bounded three ways, so they never hold the pool: a TTL (`expire`), a cap on the pages all sessions pin
together (the least recently used go first), and memory pressure (`reclaim`, called by the scheduler before it
preempts anything or refuses an admission). A released session's full pages stay in the prefix cache (and with a
host tier, spill to host memory when the pool needs them), so a late turn still finds most of its prefix.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from jaxinfer.cache.pages import PageAllocator


@dataclass
class Session:
    tokens: list[int]  # the tokens whose K/V the pages hold, in order
    pages: list[int]  # pages[j] holds tokens[j * page_size : (j + 1) * page_size]
    block_hashes: list[int]  # prefix-cache hashes of the leading full pages (as the request registered them)
    last_used: float = field(default_factory=time.monotonic)


@dataclass
class SessionMatch:
    """The part of a prompt a session holds: its pages, with a reference taken for the request."""

    session_id: str
    num_tokens: int
    pages: list[int]
    block_hashes: list[int]
    overwritten: int | None = None  # a full page the request writes into: out of the prefix cache on admission


class SessionStore:
    def __init__(self, allocator: PageAllocator, max_pages: int, ttl: float):
        self.alloc = allocator
        self.max_pages = max_pages  # 0: sessions are off
        self.ttl = ttl
        self._sessions: OrderedDict[str, Session] = OrderedDict()  # least recently used first
        # page -> sessions pinning it: conversations that share a system prompt share its full pages, which the pool
        # holds once, so the cap and the metric count each page once.
        self._pins: Counter[int] = Counter()
        # Counters for metrics and tests.
        self.hits = 0  # requests that started on a session's pages
        self.hit_tokens = 0
        self.pinned = 0  # turns pinned
        self.released = 0  # sessions released before use: TTL, cap or memory pressure

    @property
    def enabled(self) -> bool:
        return self.max_pages > 0

    @property
    def pinned_pages(self) -> int:
        """Distinct pages the sessions pin (a page two sessions share counts once)."""
        return len(self._pins)

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._sessions

    def pin(self, session_id: str, tokens: Sequence[int], pages: Sequence[int], block_hashes: Sequence[int],
            now: float | None = None) -> bool:  # fmt: skip
        """Keeps `pages` (holding `tokens`) for the session's next turn; replaces what it held. Returns whether it
        pinned (not when sessions are off, nothing is held, or the turn alone exceeds the cap)."""
        self.release(session_id)
        n = len(pages)
        if not self.enabled or not tokens or n == 0 or n > self.max_pages:
            return False
        # cap: the least recently used go first (a page another session pins already costs nothing more)
        while self.pinned_pages + sum(p not in self._pins for p in pages) > self.max_pages:
            self._drop_oldest()
        self.alloc.share(pages)
        self._sessions[session_id] = Session(list(tokens), list(pages), list(block_hashes),
                                             time.monotonic() if now is None else now)  # fmt: skip
        self._pins.update(pages)
        self.pinned += 1
        return True

    def match(self, session_id: str, tokens: Sequence[int], max_tokens: int) -> SessionMatch | None:
        """The session's pages holding the longest common prefix of `tokens` and its own (at most `max_tokens`),
        with a reference taken on each for the caller. A partly filled last page is included only when it is the
        session's own unfinished page (no one else holds or caches it); otherwise the match stops at a page edge.
        The session stays until `consume`."""
        s = self._sessions.get(session_id)
        if s is None:
            return None
        ps = self.alloc.page_size
        limit = min(max_tokens, len(tokens), len(s.tokens))
        n = 0
        while n < limit and tokens[n] == s.tokens[n]:
            n += 1
        full, rest = divmod(n, ps)
        overwritten = None
        if rest:
            own_tail = full == len(s.pages) - 1 and len(s.tokens) < len(s.pages) * ps  # partly filled: uncached
            if not own_tail and self.alloc.ref_count(s.pages[full]) == 1:  # full, held by this session alone
                overwritten = s.pages[full]
            elif not own_tail:
                n, rest = full * ps, 0
        if n == 0:
            return None
        pages = s.pages[: full + (1 if rest else 0)]
        self.alloc.share(pages)
        s.last_used = time.monotonic()
        self._sessions.move_to_end(session_id)
        return SessionMatch(session_id, n, pages, s.block_hashes[:full], overwritten)

    def consume(self, match: SessionMatch) -> None:
        """The request that matched was admitted: the session's own references go (its pages now belong to the
        request, the partly filled one to it alone)."""
        self.hits += 1
        self.hit_tokens += match.num_tokens
        if match.overwritten is not None:
            self.alloc.forget(match.overwritten)
        s = self._sessions.pop(match.session_id, None)
        if s is not None:
            self._free(s)

    def release(self, session_id: str) -> bool:
        s = self._sessions.pop(session_id, None)
        if s is None:
            return False
        self._free(s)
        return True

    def expire(self, now: float | None = None) -> int:
        """Releases the sessions idle for longer than the TTL; returns how many."""
        now = time.monotonic() if now is None else now
        n = 0
        while self._sessions:
            sid, s = next(iter(self._sessions.items()))
            if now - s.last_used < self.ttl:
                break
            self._drop_oldest()
            n += 1
        return n

    def reclaim(self, pages_needed: int) -> None:
        """Releases the least recently used sessions until `pages_needed` pages can be allocated (or none is
        left). A page still held by a running request frees nothing, so this may not reach the goal."""
        while self._sessions and self.alloc.num_free < pages_needed:
            self._drop_oldest()

    def release_all(self) -> None:
        while self._sessions:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        _, s = self._sessions.popitem(last=False)
        self.released += 1
        self._free(s)

    def _free(self, s: Session) -> None:
        self.alloc.free(s.pages)
        self._pins.subtract(s.pages)
        for p in s.pages:
            if self._pins[p] <= 0:
                self._pins.pop(p)
