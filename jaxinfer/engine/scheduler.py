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
    ):
        self.alloc = allocator
        self.max_num_seqs = max_num_seqs
        self.budget = max_num_batched_tokens
        self.long_prefill_tokens = long_prefill_tokens or max(16, max_num_batched_tokens // 4)
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
        req.block_hashes = []

    def _match_prefix(self, req: Request) -> None:
        """Starts a fresh request on the cached pages of its longest cached prefix. At least one token is left
        to compute: its logits give the next token."""
        max_blocks = (req.num_tokens - 1) // self.alloc.page_size
        if req.params.prompt_logprobs is not None:
            max_blocks = 0  # every prompt token's logits are needed, so none may come from the cache
        pages, hashes = self.alloc.match_prefix(req.tokens(0, max_blocks * self.alloc.page_size), max_blocks)
        req.pages, req.block_hashes = pages, hashes
        req.num_computed = len(pages) * self.alloc.page_size
        req.num_cached_tokens = min(req.num_computed, len(req.prompt_token_ids))

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

    def _chunk(self, req: Request, budget: int, contended: bool) -> int:
        """Tokens to compute for `req` this step. While other requests wait or run, a long prefill advances at
        most `long_prefill_tokens` per step, so it cannot hold the whole budget and starve short requests."""
        n = min(req.num_tokens - req.num_computed, budget)
        return min(n, self.long_prefill_tokens) if contended else n

    def schedule(self) -> list[ScheduledSeq]:
        budget, out = self.budget, []
        scheduled: set[int] = set()
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
        for req in list(self.waiting):
            if budget == 0 or len(out) == self.max_num_seqs:
                break
            if self._sibling_prefilling(req):
                continue
            self._match_prefix(req)
            n = self._chunk(req, budget, contended)
            if not self._reserve(req, req.num_computed + n):
                self._release(req)  # give the prefix hits back; the request keeps its place in the queue
                req.num_computed = 0
                break  # new work never preempts running work
            self.waiting.remove(req)
            req.status = Status.RUNNING
            self.running.append(req)
            out.append(ScheduledSeq(req, n))
            budget -= n
        return out
