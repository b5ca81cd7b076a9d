"""The engine loop: schedule -> run -> update. Synchronous; the async server wrapper sits on top of it."""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Sequence

from jaxinfer.cache.pages import PageAllocator
from jaxinfer.config import ModelConfig
from jaxinfer.engine.runner import CacheConfig, ModelRunner
from jaxinfer.engine.scheduler import Scheduler
from jaxinfer.model.transformer import Params
from jaxinfer.step import SeqChunk
from jaxinfer.types import Request, RequestOutput, SamplingParams, Status


class Engine:
    def __init__(
        self,
        cfg: ModelConfig,
        params: Params,
        cache: CacheConfig | None = None,
        eos_token_ids: Sequence[int] = (),
        attn_impl: str | None = None,
    ):
        cache = cache or CacheConfig()
        if cache.max_model_len > cfg.max_position_embeddings:
            cache = CacheConfig(**{**cache.__dict__, "max_model_len": cfg.max_position_embeddings})
        self.cfg, self.cc = cfg, cache
        self.runner = ModelRunner(cfg, params, cache, attn_impl)
        self.allocator = PageAllocator(self.runner.num_pages, cache.page_size, cache.enable_prefix_cache)
        self.scheduler = Scheduler(
            self.allocator, cache.max_num_seqs, cache.max_num_batched_tokens, cache.max_model_len
        )
        self.eos_token_ids = tuple(eos_token_ids)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._rng = random.Random()
        self.num_prefilled_tokens = 0

    def add_request(
        self, prompt_token_ids: Sequence[int], params: SamplingParams, request_id: str | None = None
    ) -> str:
        prompt = [int(t) for t in prompt_token_ids]
        if not prompt:
            raise ValueError("prompt: needs at least one token")
        if any(not 0 <= t < self.cfg.vocab_size for t in prompt):
            raise ValueError(f"prompt: token ids must be in [0, {self.cfg.vocab_size})")
        total = len(prompt) + params.max_tokens
        if total > self.cc.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds the maximum context "
                f"length {self.cc.max_model_len}"
            )
        if self.allocator.pages_for(total) > self.allocator.num_pages:
            raise ValueError(f"request needs {total} tokens of KV cache; the pool holds {self.runner.num_kv_tokens}")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.requests:
            raise ValueError(f"request_id {rid!r} is already in use")
        seed = params.seed if params.seed is not None else self._rng.getrandbits(32)
        req = Request(rid, prompt, params, seed)
        self.requests[rid] = req
        self.scheduler.add(req)
        return rid

    def abort(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is not None and req.status is not Status.FINISHED:
            self.scheduler.finish(req, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def _stop_reason(self, req: Request, token: int) -> str | None:
        p = req.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            return "stop"
        if len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.cc.max_model_len:
            return "length"
        return None

    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if not batch:
            return []
        chunks = [
            SeqChunk(
                s.req.tokens(s.req.num_computed, s.req.num_computed + s.num_new),
                s.req.num_computed,
                s.req.pages,
                s.req.params.temperature,
                s.req.seed,
                len(s.req.output_token_ids),
            )
            for s in batch
        ]
        tokens, _ = self.runner.run(chunks)
        now = time.monotonic()
        outputs = []
        for s, tok in zip(batch, tokens, strict=True):
            req = s.req
            samples = s.samples
            if req.num_computed < len(req.prompt_token_ids):
                self.num_prefilled_tokens += min(s.num_new, len(req.prompt_token_ids) - req.num_computed)
            req.num_computed += s.num_new
            self.scheduler.commit(req)
            if not samples:
                continue
            req.output_token_ids.append(int(tok))
            req.first_token_time = req.first_token_time or now
            reason = self._stop_reason(req, int(tok))
            if reason:
                self.scheduler.finish(req, reason)
                req.finish_time = now
                self.requests.pop(req.request_id, None)
            outputs.append(
                RequestOutput(req.request_id, req.prompt_token_ids, list(req.output_token_ids), reason is not None,
                              reason)
            )  # fmt: skip
        return outputs

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[RequestOutput]:
        """Runs a batch of token-id prompts to completion; outputs in prompt order."""
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist, strict=True)]
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished():
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]
