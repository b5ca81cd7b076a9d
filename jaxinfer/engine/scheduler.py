"""Continuous batching with chunked prefill and preemption. Plain Python: never imports jax.

Each step: first every running sequence that is decoding gets its one token, then running sequences still in
prefill continue with a chunk, then waiting requests are admitted first-come-first-served, all under a token
budget and a maximum number of sequences. When pages run out the youngest running request is preempted: its
pages are freed and it goes back to the front of the queue to be recomputed later (its output so far is kept).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from jaxinfer.cache.pages import PageAllocator
from jaxinfer.types import Request, Status


@dataclass
class ScheduledSeq:
    req: Request
    num_new: int  # tokens computed this step, starting at req.num_computed

    @property
    def samples(self) -> bool:
        """Whether this step completes the known tokens, so its sampled token is the next output."""
        return self.req.num_computed + self.num_new == self.req.num_tokens


class Scheduler:
    def __init__(self, allocator: PageAllocator, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int):
        self.alloc = allocator
        self.max_num_seqs = max_num_seqs
        self.budget = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _release(self, req: Request) -> None:
        self.alloc.free(req.pages)
        req.pages = []

    def finish(self, req: Request, reason: str) -> None:
        """Ends a request wherever it is (running, waiting) and returns its pages."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._release(req)
        req.status, req.finish_reason = Status.FINISHED, reason

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
            if not self.alloc.can_allocate(need):
                return False
            req.pages += self.alloc.allocate(need)
        return True

    def schedule(self) -> list[ScheduledSeq]:
        budget, out = self.budget, []
        scheduled: set[int] = set()
        decoding = [r for r in self.running if r.num_tokens - r.num_computed == 1]
        prefilling = [r for r in self.running if r.num_tokens - r.num_computed > 1]
        for req in decoding + prefilling:
            if budget == 0 or len(out) == self.max_num_seqs:
                break
            if req.status is not Status.RUNNING:  # preempted earlier in this loop
                continue
            n = min(req.num_tokens - req.num_computed, budget)
            while not self._reserve(req, req.num_computed + n):
                victims = [r for r in self.running if id(r) not in scheduled]
                victim = max(victims, key=lambda r: r.arrival_time)
                self._preempt(victim)
                if victim is req:
                    break
            if req.status is not Status.RUNNING:
                continue
            out.append(ScheduledSeq(req, n))
            scheduled.add(id(req))
            budget -= n
        while self.waiting and budget > 0 and len(out) < self.max_num_seqs:
            req = self.waiting[0]
            n = min(req.num_tokens - req.num_computed, budget)
            if not self._reserve(req, req.num_computed + n):
                break  # new work never preempts running work
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            out.append(ScheduledSeq(req, n))
            budget -= n
        return out
