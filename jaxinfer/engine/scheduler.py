"""Continuous batching with chunked prefill and preemption. Plain Python: never imports jax.

Each step: first every running sequence that is decoding gets its one token, then running sequences still in
prefill continue with a chunk, then waiting requests are admitted first-come-first-served, all under a token
budget and a maximum number of sequences. When pages run out the youngest running request is preempted: its
pages are freed and it goes back to the front of the queue to be recomputed later (its output so far is kept).

A fresh request starts on the longest prefix already computed: its session's pinned pages (jaxinfer.cache.sessions)
when it names one, else the device prefix cache, continued in the host tier (jaxinfer.cache.host_tier) where the
device missed. A host hit gets a fresh page now and its K/V is copied in by the engine before the step runs: the
scheduler records, in order, every cached block the allocator evicted and every page to load (`kv_events`), and the
engine turns them into copies (jaxinfer.engine.kv_copy). Before preempting or refusing work for want of pages, the
scheduler releases pinned sessions (least recently used first).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass

from jaxinfer.cache.host_tier import HostTier
from jaxinfer.cache.pages import PageAllocator, block_hash
from jaxinfer.cache.sessions import SessionMatch, SessionStore
from jaxinfer.types import Request, Status

# A finished turn keeps its pages for the next one only when it ended normally (not aborted, failed or preempted).
PIN_REASONS = ("stop", "length")


@dataclass
class Evicted:
    """The allocator reused page `page`, which cached block `block_hash` (`tokens`): copy it out first."""

    page: int
    block_hash: int
    tokens: tuple[int, ...]


@dataclass
class Load:
    """Page `page` was given to block `block_hash`, found in the host tier: copy `kv` in before the step."""

    page: int
    block_hash: int
    kv: object  # the host tier's array


@dataclass
class ScheduledSeq:
    req: Request
    num_new: int  # tokens computed this step, starting at req.num_computed when scheduled
    # Whether this step completes the known tokens, so its sampled token is the next output (fixed when
    # scheduled: the engine advances num_computed as soon as it dispatches the step).
    samples: bool = False
    out_index: int = -1  # where its sampled token goes in req.output_token_ids (set by the engine)
    prefill_chunk: list | None = None  # its entry in req.prefill_chunks, completed when the step is read (engine)

    def __post_init__(self) -> None:
        self.samples = self.req.num_computed + self.num_new == self.req.num_tokens


class Scheduler:
    def __init__(
        self,
        allocator: PageAllocator,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        long_prefill_tokens: int | None = None,
        sessions: SessionStore | None = None,
        host: HostTier | None = None,
    ):
        self.alloc = allocator
        self.sessions = sessions if sessions is not None and sessions.enabled else None
        self.host = host if host is not None and host.enabled and allocator.enable_prefix_cache else None
        if self.host is not None:
            allocator.evicted = []
        self.kv_events: list[Evicted | Load] = []  # taken by the engine before each dispatch
        self.host_hit_tokens = 0
        self.max_num_seqs = max_num_seqs
        self.budget = max_num_batched_tokens
        self.long_prefill_tokens = long_prefill_tokens or max(16, max_num_batched_tokens // 4)
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._added = itertools.count()

    def add(self, req: Request) -> None:
        req.queue_order = next(self._added)
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _release(self, req: Request) -> None:
        self.alloc.free(req.pages)
        req.pages = []
        req.block_hashes = []

    def _match_prefix(self, req: Request) -> SessionMatch | None:
        """Starts a fresh request on the pages of its longest computed prefix: its session's, else the prefix
        cache's (device, then host tier). At least one token is left to compute: its logits give the next token.
        Returns the session match, which the caller consumes once the request is admitted."""
        limit = req.num_tokens - 1
        if req.params.prompt_logprobs is not None:
            limit = 0  # every prompt token's logits are needed, so none may come from the cache
        sid = req.params.session_id
        match = None
        # The usage and metrics report what the cache held at a request's first admission: after a preemption
        # the match finds the request's own pages again, which no cache saved it (vLLM counts the first only).
        first = req.num_preemptions == 0
        if first:
            req.num_host_cached_tokens = 0 if self.host is not None else None
        if limit and sid is not None and self.sessions is not None and req.group is None:
            match = self.sessions.match(sid, req.tokens(0, limit), limit)
        if match is not None:
            req.pages, req.block_hashes, req.num_computed = match.pages, match.block_hashes, match.num_tokens
        else:
            max_blocks = limit // self.alloc.page_size
            tokens = req.tokens(0, max_blocks * self.alloc.page_size)
            pages, hashes = self.alloc.match_prefix(tokens, max_blocks)
            if self.host is not None:
                before = self.host_hit_tokens
                self._match_host(tokens, pages, hashes, max_blocks)
                if first:
                    req.num_host_cached_tokens = self.host_hit_tokens - before
            req.pages, req.block_hashes = pages, hashes
            req.num_computed = len(pages) * self.alloc.page_size
        if first:
            req.num_cached_tokens = min(req.num_computed, len(req.prompt_token_ids))
        return match

    def _match_host(self, tokens: list[int], pages: list[int], hashes: list[int], max_blocks: int) -> None:
        """Continues a device prefix match block by block, on the device or else in the host tier: a block found
        there gets a fresh page (registered in the device prefix cache at once, so others share it) and a Load.
        The device blocks are taken first, so that the pages the loads allocate cannot evict them."""
        ps = self.alloc.page_size
        found: list[tuple[int, tuple[int, ...], int | None]] = []  # (hash, block, device page or None: host)
        parent = hashes[-1] if hashes else None
        for j in range(len(pages), max_blocks):
            block = tuple(tokens[j * ps : (j + 1) * ps])
            h = block_hash(parent, block)
            page = self.alloc.take_cached(h, block)  # a later block may still be on the device
            if page is None and h not in self.host:
                break
            found.append((h, block, page))
            parent = h
        for i, (h, block, page) in enumerate(found):
            kv = None
            if page is None and self.alloc.can_allocate(1):
                kv = self.host.get(h, block)  # None: a hash collision, another block under this hash
            if page is None and kv is None:
                self.alloc.free([p for _, _, p in found[i + 1 :] if p is not None])  # the chain breaks here
                return
            if page is None:
                (page,) = self.alloc.allocate(1)
                self._take_evictions()  # before the load: an eviction of this page copies its old block out first
                self.alloc.register(page, hashes[-1] if hashes else None, block)
                self.kv_events.append(Load(page, h, kv))
                self.host_hit_tokens += ps
            pages.append(page)
            hashes.append(h)

    def _take_evictions(self) -> None:
        if self.alloc.evicted:
            self.kv_events += [Evicted(*e) for e in self.alloc.evicted]
            self.alloc.evicted.clear()

    def take_kv_events(self) -> list[Evicted | Load]:
        """The evictions and loads since the last call, in the order they happened."""
        self._take_evictions()
        events, self.kv_events = self.kv_events, []
        return events

    def commit(self, req: Request) -> None:
        """Registers the request's newly completed full pages in the prefix cache (after a step ran)."""
        ps = self.alloc.page_size
        for j in range(len(req.block_hashes), req.num_computed // ps):
            parent = req.block_hashes[-1] if req.block_hashes else None
            block = req.tokens(j * ps, (j + 1) * ps)
            if min(block) < 0:  # a token still in flight (overlap): register this page after it is known
                return
            req.block_hashes.append(self.alloc.register(req.pages[j], parent, block))

    def reached_length(self, req: Request) -> bool:
        """Whether the request has all its tokens (counting any still in flight): it ends with "length"."""
        return len(req.output_token_ids) >= req.params.max_tokens or req.num_tokens >= self.max_model_len

    def _sibling_prefilling(self, req: Request) -> bool:
        """An n > 1 sibling still computing the shared prompt: wait for it and then reuse its pages. Its pages are
        reusable once registered, after its step ran (with overlap scheduling that is a step after dispatch)."""
        shareable = (len(req.prompt_token_ids) - 1) // self.alloc.page_size
        return req.group is not None and any(
            r.group == req.group and (r.num_computed < len(r.prompt_token_ids) or len(r.block_hashes) < shareable)
            for r in self.running
        )

    def finish(self, req: Request, reason: str) -> None:
        """Ends a request wherever it is (running, waiting) and returns its pages (a session keeps them)."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if reason in PIN_REASONS and req.params.session_id is not None and self.sessions is not None:
            self._pin(req)
        self._release(req)
        req.status, req.finish_reason = Status.FINISHED, reason

    def _pin(self, req: Request) -> None:
        """The session keeps the pages of every token whose K/V is computed or in flight (the last sampled token
        has none yet); n > 1 samples pin nothing (which one would the conversation continue?)."""
        if req.group is not None:
            return
        tokens = req.tokens(0, min(req.num_computed, req.num_tokens))
        known = next((i for i, t in enumerate(tokens) if t < 0), len(tokens))  # tokens still in flight: not yet
        tokens = tokens[:known]
        ps = self.alloc.page_size
        self.sessions.pin(req.params.session_id, tokens, req.pages[: self.alloc.pages_for(len(tokens))],
                          req.block_hashes[: len(tokens) // ps])  # fmt: skip

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._release(req)
        req.num_computed = 0
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.waiting.appendleft(req)

    def _reserve(self, req: Request, num_tokens: int) -> bool:
        need = self.alloc.pages_for(num_tokens) - len(req.pages)
        if need > 0:
            if not self.alloc.can_allocate(need) and self.sessions is not None:
                self.sessions.reclaim(need)  # pinned conversations give way before running work does
            if not self.alloc.can_allocate(need):
                return False
            req.pages += self.alloc.allocate(need)
        return True

    def _chunk(self, req: Request, budget: int, contended: bool) -> int:
        """Tokens to compute for `req` this step. While other requests wait or run, a long prefill advances at
        most `long_prefill_tokens` per step, so it cannot hold the whole budget and starve short requests."""
        n = min(req.num_tokens - req.num_computed, budget)
        return min(n, self.long_prefill_tokens) if contended else n

    def expire_sessions(self, now: float | None = None) -> None:
        if self.sessions is not None:
            self.sessions.expire(time.monotonic() if now is None else now)

    def schedule(self) -> list[ScheduledSeq]:
        self.expire_sessions()
        budget, out = self.budget, []
        scheduled: set[int] = set()
        preempted = False
        decoding = [r for r in self.running if r.num_tokens - r.num_computed == 1]
        prefilling = [r for r in self.running if r.num_tokens - r.num_computed > 1]
        contended = len(self.running) + len(self.waiting) > 1
        for req in decoding + prefilling:
            if budget == 0 or len(out) == self.max_num_seqs:
                break
            if req.status is not Status.RUNNING:  # preempted earlier in this loop
                continue
            if self.reached_length(req):  # its last token is still in flight (overlap) and then it ends
                continue
            n = self._chunk(req, budget, contended)
            while not self._reserve(req, req.num_computed + n):
                # The newest running request gives way, as vLLM's FCFS: even one scheduled earlier in this step (a
                # newer decode ahead of an older prefill), which leaves the step again. Picking among the
                # unscheduled only made an older prefill preempt itself again and again while newer requests
                # ran; and n > 1 samples, of one arrival time, preempted each other forever.
                victim = max(self.running, key=lambda r: r.queue_order)
                if id(victim) in scheduled:
                    dropped = next(s for s in out if s.req is victim)
                    out.remove(dropped)
                    scheduled.discard(id(victim))
                    budget += dropped.num_new
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            if req.status is not Status.RUNNING:
                continue
            out.append(ScheduledSeq(req, n))
            scheduled.add(id(req))
            budget -= n
        if preempted:  # as vLLM: the pages just freed go to the preempted requests first, not to new ones
            return out
        for req in list(self.waiting):
            if budget == 0 or len(out) == self.max_num_seqs:
                break
            if self._sibling_prefilling(req):
                continue
            match = self._match_prefix(req)
            n = self._chunk(req, budget, contended)
            if not self._reserve(req, req.num_computed + n):
                self._release(req)  # give the prefix hits back; the request keeps its place in the queue
                req.num_computed = 0
                break  # new work never preempts running work
            if match is not None:
                self.sessions.consume(match)
            self.waiting.remove(req)
            req.status = Status.RUNNING
            self.running.append(req)
            out.append(ScheduledSeq(req, n))
            budget -= n
        return out
