"""The engine loop: schedule -> run -> update. Token ids in, token ids out; text lives a layer above.

Synchronous and single-threaded: `LLM` drives it directly, `AsyncEngine` from a background thread.

Failure isolation: an exception while preparing or finishing one request ends that request (and its n siblings)
with finish_reason "error" and an error message in its SeqUpdate; its pages go back to the pool and the others go
on. An exception dispatching a step (packing, transfer, tracing: nothing ran on the device) cannot be blamed on
one row: the step's requests end with "error" and the engine keeps serving. An error from the device itself
leaves the KV pool unusable: `step()` raises EngineFatalError and the caller stops serving.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import random
import time
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxinfer.cache.host_tier import HostTier, host_tier_bytes
from jaxinfer.cache.pages import PageAllocator
from jaxinfer.cache.sessions import SessionStore
from jaxinfer.config import ModelConfig
from jaxinfer.engine.config import CacheConfig
from jaxinfer.engine.grammar import GrammarCompiler, grammar_text
from jaxinfer.engine.runner import ModelRunner, placeholder
from jaxinfer.engine.scheduler import Evicted, Load, Scheduler
from jaxinfer.model.transformer import Params
from jaxinfer.sampling import BAD_WORD_MAX_TOKENS, BAD_WORDS_CAP, RowSampling
from jaxinfer.step import SeqChunk
from jaxinfer.types import Request, SamplingParams, SeqTiming, SeqUpdate, Status, is_integer

log = logging.getLogger(__name__)

# Test hook: preparing a request whose id (its group id for n > 1) starts with this raises, as a bug would. The
# server starts engine ids with the client's X-Request-Id.
FAULT_REQUEST_ENV = "JAXINFER_FAULT_REQUEST"


def min_tokens_banned(params: SamplingParams, eos_token_ids: tuple[int, ...]) -> tuple[int, ...]:
    """The ids a row's bias bans until min_tokens: its stop ids, and EOS unless ignore_eos (vLLM v1's rule)."""
    return params.stop_token_ids + (() if params.ignore_eos else eos_token_ids)


def check_bad_words(params: SamplingParams, vocab_size: int) -> None:
    """bad_words as the engine takes them: tokenized, in the vocabulary, within the sampler's arrays."""
    seqs = params.bad_words_token_ids
    if params.bad_words is not None and seqs is None:
        raise ValueError("bad_words: the engine takes them as token ids (bad_words_token_ids); LLM and the server "
                         "tokenize them (jaxinfer.types.with_bad_words_ids)")  # fmt: skip
    name = "bad_words" if params.bad_words is not None else "bad_words_token_ids"
    seqs = seqs or ()
    if any(not 0 <= t < vocab_size for q in seqs for t in q):
        raise ValueError(f"{name}: token ids must be in [0, {vocab_size})")
    if len(seqs) > BAD_WORDS_CAP:
        also = " (a word counts twice when its form after a space is other tokens)" if params.bad_words else ""
        raise ValueError(f"{name}: at most {BAD_WORDS_CAP} token sequences are supported, got {len(seqs)}{also}")
    longest = max((len(q) for q in seqs), default=0)
    if longest > BAD_WORD_MAX_TOKENS:
        raise ValueError(f"{name}: a word may be at most {BAD_WORD_MAX_TOKENS} tokens long, got one of {longest}")


class EngineFatalError(RuntimeError):
    """The device failed: the KV pool (and every request in it) is gone; the engine cannot serve any more."""


class Engine:
    def __init__(
        self,
        cfg: ModelConfig,
        params: Params,
        cache: CacheConfig | None = None,
        eos_token_ids: Sequence[int] = (),
        attn_impl: str | None = None,
        seed: int | None = None,
        mesh: Mesh | None = None,
        overlap: bool = True,
        donate_params: bool = False,
    ):
        """overlap: dispatch step N+1 before reading step N's tokens (they feed N+1 on the device), so the host's
        work on N's results runs while the device computes. Outputs are the same either way; off helps debugging.
        donate_params: the caller gives `params` up (see ModelRunner): `build_engine` does, for weights it loaded."""
        cache = cache or CacheConfig()
        if cache.max_model_len > cfg.max_position_embeddings:
            raise ValueError(
                f"max_model_len: {cache.max_model_len} exceeds the model's context length {cfg.max_position_embeddings}"
            )
        if cache.max_logprobs > cfg.vocab_size:
            raise ValueError(f"max_logprobs: {cache.max_logprobs} exceeds the vocabulary size {cfg.vocab_size}")
        self.runner = ModelRunner(cfg, params, cache, attn_impl, mesh, donate_params)
        if self.runner.num_kv_tokens < cache.max_model_len:
            # A sequence holds no more than the whole pool: that is the context every check, stop rule and the
            # scheduler use (a request let up to max_model_len preempted itself at the pool's end, forever). So a
            # request that fits the context fits the pool, and `validate` needs no check of its own for that.
            log.warning("the KV pool holds %d tokens, fewer than max_model_len %d: a sequence holds at most %d "
                        "(raise --kv-cache-memory or lower --max-model-len)", self.runner.num_kv_tokens,
                        cache.max_model_len, self.runner.num_kv_tokens)  # fmt: skip
            cache = dataclasses.replace(cache, max_model_len=self.runner.num_kv_tokens)
        self.cfg, self.cc = cfg, cache
        self.allocator = PageAllocator(self.runner.num_pages, cache.block_size, cache.enable_prefix_caching)
        pin_cap = cache.session_cache_pages if cache.session_cache_pages is not None else self.runner.num_pages // 4
        self.sessions = SessionStore(self.allocator, min(pin_cap, self.runner.num_pages), cache.session_ttl)
        self.host = self._host_tier(cache)
        self.scheduler = Scheduler(
            self.allocator, cache.max_num_seqs, cache.max_num_batched_tokens, cache.max_model_len,
            sessions=self.sessions, host=self.host,
        )  # fmt: skip
        self._spills: list[tuple[list, list[Evicted]]] = []  # page copies on their way to the host tier
        self._spilling: set[int] = set()  # their block hashes
        self.eos_token_ids = tuple(eos_token_ids)
        self.seqs: dict[str, Request] = {}  # live sequences by sequence id
        self.groups: dict[str, list[str]] = {}  # request id -> its sequence ids (n of them)
        self._ids = itertools.count()
        self._rng = random.Random(seed)
        self.overlap = overlap
        self._in_flight: tuple | None = None  # with overlap: the dispatched step whose tokens are not read yet
        # Updates the next step returns first: failed requests', and a step collected early (_collect_for_grammars).
        self._unreported: list[SeqUpdate] = []
        self.fault_request = os.environ.get(FAULT_REQUEST_ENV) or None
        # What a request's unset sampling fields default to (the model's generation_config.json: build_engine).
        self.sampling_defaults: dict[str, float | int] = {}
        self.driver: object | None = None  # the AsyncEngine stepping this engine from its thread, if one does
        # Structured outputs' grammars, for the tokenizer's tokens (build_engine sets it; None: they are refused).
        self.grammars: GrammarCompiler | None = None
        # Counters for metrics and tests.
        self.num_prefilled_tokens = 0
        self.num_generated_tokens = 0
        self.num_steps = 0

    def _host_tier(self, cache: CacheConfig) -> HostTier | None:
        """The host tier, when it has memory, the prefix cache is on (it stores prefix-cache blocks) and one
        process drives the mesh (its copies are not broadcast to followers)."""
        nbytes = host_tier_bytes(cache.host_kv_cache_memory, jax.default_backend())
        if nbytes == 0:
            return None
        why_not = None
        if not cache.enable_prefix_caching:
            why_not = "it keeps prefix-cache pages and prefix caching is off"
        elif jax.process_count() > 1:
            why_not = "its page copies are not broadcast to the other processes of a multi-host mesh"
        block_bytes = self.runner.page_bytes  # a host block is a page as the pools store it (padding included)
        host = HostTier(nbytes, block_bytes)
        if why_not is None and not host.enabled:
            why_not = f"{nbytes} bytes hold no page ({block_bytes} bytes each)"
        if why_not is not None:
            log.warning("host KV tier off: %s", why_not)
            return None
        self.runner.enable_page_copies()
        log.info("host KV tier: %d pages (%.1f MiB)", host.max_blocks, host.capacity_bytes / 2**20)
        return host

    # ------------------------------------------------------------------------------------------ sessions and tiers

    def cache_stats(self) -> dict[str, float]:
        """Prefix cache, pinned sessions and host tier counters (metrics, tests, benchmarks)."""
        s, h = self.sessions, self.host
        return {
            "prefix_cache_hit_rate": self.allocator.hit_rate,
            "sessions": len(s),
            "session_hits": s.hits,
            "session_hit_tokens": s.hit_tokens,
            "session_pinned_pages": s.pinned_pages,
            "host_kv_hits": h.hits if h else 0,
            "host_kv_hit_tokens": self.scheduler.host_hit_tokens,
            "host_kv_spills": h.spills if h else 0,
            "host_kv_bytes": h.used_bytes if h else 0,
            "host_kv_capacity_bytes": h.capacity_bytes if h else 0,
        }

    def expire_sessions(self) -> None:
        """Releases sessions past their TTL (the schedule does it too; an idle loop calls this)."""
        self.scheduler.expire_sessions()

    def release_sessions(self) -> None:
        """Releases every pinned session (shutdown): their pages go back to the pool."""
        self.sessions.release_all()

    def recover(self) -> bool:
        """After an exception (Ctrl-C) escaped a step whose requests were all aborted since: when it struck between
        the device call and the runner keeping the step's outputs, the KV pools that call donated are gone. Fresh
        pools then replace them, and what referred to their contents goes too (the step in flight, the prefix cache,
        pinned sessions). True when that happened; the engine serves as before either way."""
        if not self.runner.pools_lost():
            return False
        log.warning("a step was interrupted after it took the KV pools: starting from fresh ones")
        self._in_flight = None
        self.runner.reset_pools()
        self.release_sessions()
        self.allocator.reset_prefix_cache()
        return True

    def update_weights(self, params: Params | nnx.Module) -> None:
        """Serves the next requests with new values of the same model (`ModelRunner.update_weights`): a module after
        training steps, say. Between requests only. The KV cached for prefixes, sessions and the host tier was
        computed with the old weights, so it is dropped."""
        if self.has_unfinished():
            raise RuntimeError("update_weights: requests are still running; update the weights between them")
        self.runner.update_weights(params)
        self.release_sessions()
        self.reset_prefix_cache()

    def reset_prefix_cache(self) -> None:
        """Forgets the KV cached for prompt prefixes, on the device and in the host tier (vLLM's
        `reset_prefix_cache`): the next requests compute their prompts in full, as a benchmark's later rounds must.
        Pinned sessions keep theirs (`release_sessions` lets them go)."""
        self.allocator.reset_prefix_cache()
        if self.host is not None:
            self.host.clear()

    def _move_kv(self) -> None:
        """Turns the scheduler's evictions and host hits into page copies, before the step is dispatched: cached
        blocks about to be overwritten go out to the host tier (unless it holds them already), host hits come in.
        A load whose page was evicted again before landing is dropped (the host tier still has its block)."""
        events = self.scheduler.take_kv_events()
        if not events:
            return
        loads: dict[int, Load] = {}
        spills: list[Evicted] = []
        for ev in events:
            if isinstance(ev, Load):
                loads[ev.page] = ev
                continue
            pending = loads.get(ev.page)
            if pending is not None and pending.block_hash == ev.block_hash:
                del loads[ev.page]  # never landed: the page holds something else
                continue
            if ev.block_hash in self.host or ev.block_hash in self._spilling:
                continue
            spills.append(ev)
            self._spilling.add(ev.block_hash)
        if spills:  # first: a page spilled and loaded in one schedule is read before it is written
            try:
                self._spills.append((self.runner.gather_pages([e.page for e in spills]), spills))
            except Exception as e:  # a lost spill costs a recompute later, never a wrong token
                log.warning("copying %d KV pages to the host tier failed: %s", len(spills), e)
                self._spilling.clear()
        if loads:
            try:
                self.runner.scatter_pages(list(loads), [np.asarray(ld.kv) for ld in loads.values()])
            except Exception as e:
                # The pages are in the prefix cache already: without their K/V nothing in the pool can be trusted.
                raise EngineFatalError(f"copying KV pages back from the host tier failed: {e}") from e

    def _store_spills(self) -> None:
        """Moves finished page copies into the host tier (their device copies were dispatched before the step
        just collected, so they are done or nearly)."""
        for pieces, evicted in self._spills:
            try:
                blocks = self.runner.pages_to_host(pieces)
            except Exception as e:  # as in _move_kv: the blocks are recomputed when next needed
                log.warning("copying %d KV pages to the host tier failed: %s", len(evicted), e)
                continue
            for ev, block in zip(evicted, blocks, strict=True):
                self.host.put(ev.block_hash, ev.tokens, block)
        self._spills.clear()
        self._spilling.clear()

    # ------------------------------------------------------------------------------------------ requests

    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> list[int]:
        """Raises ValueError naming the problem; returns the prompt as a list of ints."""
        if not all(is_integer(t) for t in prompt_token_ids):
            raise ValueError("prompt: token ids must be integers")
        prompt = [int(t) for t in prompt_token_ids]
        if not prompt:
            raise ValueError("prompt: needs at least one token")
        if any(not 0 <= t < self.cfg.vocab_size for t in prompt):
            raise ValueError(f"prompt: token ids must be in [0, {self.cfg.vocab_size})")
        context = self.cc.max_model_len
        limit = f"{context} (the KV pool's size)" if context == self.runner.num_kv_tokens else f"{context}"
        if len(prompt) >= context:
            raise ValueError(f"prompt: {len(prompt)} tokens leave no room to generate in the maximum context length "
                             f"{limit}")  # fmt: skip
        max_tokens = resolved_max_tokens(params, len(prompt), context)
        if len(prompt) + max_tokens > context:
            raise ValueError(
                f"max_tokens: prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceeds the maximum "
                f"context length {limit}"
            )
        if params.logprobs is not None and params.logprobs > self.cc.max_logprobs:
            raise ValueError(f"logprobs: at most {self.cc.max_logprobs} are supported, got {params.logprobs}")
        if params.prompt_logprobs is not None and params.prompt_logprobs > self.cc.max_logprobs:
            raise ValueError(
                f"prompt_logprobs: at most {self.cc.max_logprobs} are supported, got {params.prompt_logprobs}"
            )
        allowed = params.allowed_token_ids or ()
        for name, ids in (("logit_bias", params.logit_bias or {}), ("stop_token_ids", params.stop_token_ids),
                          ("allowed_token_ids", allowed)):  # fmt: skip
            if any(not 0 <= t < self.cfg.vocab_size for t in ids):
                raise ValueError(f"{name}: token ids must be in [0, {self.cfg.vocab_size})")
        check_bad_words(params, self.cfg.vocab_size)
        if params.structured_outputs is not None:
            grammar_text(params.structured_outputs)  # a schema, regex or grammar that does not compile: ValueError
        # Until min_tokens, the row's bias also bans the stop ids (`_row`), and allowed_token_ids are bias entries
        # too: they share the capacity.
        banned = set(min_tokens_banned(params, self.eos_token_ids)) if params.min_tokens > 0 else set()
        if allowed and set(allowed) <= banned:
            raise ValueError("allowed_token_ids: every allowed token is a stop or EOS id, which min_tokens bans until "
                             "then: no token could be sampled")  # fmt: skip
        biased = set(allowed) if allowed else set(params.logit_bias or {})
        bias = len(biased | banned)
        if bias > self.cc.logit_bias_capacity:
            name = "allowed_token_ids" if allowed else "logit_bias"
            also = f" ({len(banned)} of them the stop and EOS ids that min_tokens bans)" if banned else ""
            raise ValueError(f"{name}: at most {self.cc.logit_bias_capacity} entries are supported, got {bias}"
                             f"{also}")  # fmt: skip
        return prompt

    def add_request(
        self, prompt_token_ids: Sequence[int], params: SamplingParams, request_id: str | None = None
    ) -> str:
        """Queues a request (n sequences when params.n > 1, sharing the prompt's pages); returns its id."""
        prompt = self.validate(prompt_token_ids, params)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.groups:
            raise ValueError(f"request_id {rid!r} is already in use")
        if params.max_tokens is None:
            rest = resolved_max_tokens(params, len(prompt), self.cc.max_model_len)
            params = dataclasses.replace(params, max_tokens=rest, min_tokens=min(params.min_tokens, rest))
        grammar = None
        if params.structured_outputs is not None:
            if self.grammars is None:
                raise ValueError("structured_outputs: this engine has no tokenizer to constrain with (engines that "
                                 "build_engine or LLM made have one)")  # fmt: skip
            grammar = self.grammars.grammar(params.structured_outputs)
        base_seed = device_seed(params.seed) if params.seed is not None else self._rng.getrandbits(32)
        sids = [rid] if params.n == 1 else [f"{rid}#{i}" for i in range(params.n)]
        now = time.monotonic()
        for i, sid in enumerate(sids):
            req = Request(sid, prompt, params, sample_seed(base_seed, i), arrival_time=now,
                          group=rid if params.n > 1 else None)  # fmt: skip
            req.grammar = grammar if i == 0 or grammar is None else grammar.copy()
            self.seqs[sid] = req
            self.scheduler.add(req)
        self.groups[rid] = sids
        return rid

    def abort(self, request_id: str) -> None:
        """Ends a request (all its sequences) wherever it is; its pages return to the pool at once."""
        for sid in self.groups.pop(request_id, []):
            req = self.seqs.pop(sid, None)
            if req is not None and req.status is not Status.FINISHED:
                self._end(req, "abort")

    def finish_sequence(self, seq_id: str, reason: str, stop_reason: int | str | None = None) -> None:
        """Ends one sequence early (a stop string found by the detokenizer)."""
        req = self.seqs.pop(seq_id, None)
        if req is not None and req.status is not Status.FINISHED:
            self._end(req, reason)
            req.stop_reason = stop_reason
            req.finish_time = time.monotonic()
        self._forget_group(req)

    def _end(self, req: Request, reason: str) -> None:
        """Ends a sequence: its pages go back to the pool now. A step in flight may still compute it (overlap);
        the device runs steps in order, so whatever reuses the pages runs after that step's writes, and the
        step's token for it is dropped when collected."""
        self.scheduler.finish(req, reason)
        while req.output_token_ids and req.output_token_ids[-1] < 0:  # placeholders of tokens in flight
            req.output_token_ids.pop()

    def _forget_group(self, req: Request | None) -> None:
        if req is None:
            return
        rid = req.group or req.request_id
        if all(s not in self.seqs for s in self.groups.get(rid, [])):
            self.groups.pop(rid, None)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self._in_flight is not None or bool(self._unreported)

    def largest(self) -> Engine:
        """The engine whose limits (KV pool, pages) a request is checked against: this one. (DataParallelEngine:
        its largest replica.)"""
        return self

    # ------------------------------------------------------------------------------------------ failures

    def _fail(self, req: Request, error: BaseException | str) -> None:
        """Ends the request (all n of its sequences) with finish_reason "error"; the next step reports it."""
        msg = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        rid = req.group or req.request_id
        log.error("request %s failed in the engine: %s", rid, msg, exc_info=isinstance(error, BaseException))
        now = time.monotonic()
        for sid in self.groups.pop(rid, [req.request_id]):
            seq = self.seqs.pop(sid, None)
            if seq is None or seq.status is Status.FINISHED:
                continue
            self._end(seq, "error")
            seq.finish_time = now
            self._unreported.append(SeqUpdate(sid, [], [], True, "error", None, error=msg))

    def _fail_step(self, batch: list, error: BaseException) -> None:
        """A step failed as a whole: its requests end with "error". Raises EngineFatalError when the device state
        did not survive (an error that happened on the device poisons the KV pool the step returned)."""
        msg = f"the engine step failed: {type(error).__name__}: {error}"
        if any(isinstance(w, jax.Array) and w.is_deleted() for w in self.runner.weights):
            msg = ("the model's weights were deleted or donated after the engine was built (by a jit with "
                   "donate_argnums over the module, say): pass the new ones to update_weights()")  # fmt: skip
        for s in batch:
            if s.req.status is not Status.FINISHED:
                self._fail(s.req, msg)
        try:
            jax.block_until_ready((self.runner.kv, self.runner.feed))
        except Exception as e:
            raise EngineFatalError(f"the device failed: {e}") from error

    def _take_unreported(self) -> list[SeqUpdate]:
        updates, self._unreported = self._unreported, []
        return updates

    def _prepare(self, r: Request, num_new: int) -> tuple[SeqChunk, RowSampling]:
        """One scheduled sequence's chunk (with prompt-logprob targets when asked for) and sampling row."""
        if self.fault_request is not None and (r.group or r.request_id).startswith(self.fault_request):
            raise RuntimeError(f"injected failure for request {self.fault_request} (${FAULT_REQUEST_ENV})")
        start, stop, n_prompt = r.num_computed, r.num_computed + num_new, len(r.prompt_token_ids)
        targets = None
        if r.params.prompt_logprobs is not None and start < n_prompt:
            # Each prompt token's logits score the prompt token after it.
            targets = [r.prompt_token_ids[p + 1] if p + 1 < n_prompt else -1 for p in range(start, stop)]
        return SeqChunk(r.tokens(start, stop), start, r.pages, targets), self._row(r)

    # ------------------------------------------------------------------------------------------ the step

    def _row(self, req: Request) -> RowSampling:
        p = req.params
        bias = dict(p.logit_bias or {})
        if p.allowed_token_ids:  # the allowed tokens as bias entries (their logit_bias, else 0); the rest are out
            bias = {t: bias.get(t, 0.0) for t in p.allowed_token_ids}
        # min_tokens: the stop ids are banned until then, unless a complete grammar allows only EOS: it ends there.
        if len(req.output_token_ids) < p.min_tokens and not (req.grammar is not None and req.grammar.done):
            bias.update({t: float("-inf") for t in min_tokens_banned(p, self.eos_token_ids)})
        return RowSampling(
            # top_k at or past the vocabulary keeps every token: 0 says so without overflowing int32.
            temperature=p.temperature, top_k=p.top_k if p.top_k < self.cfg.vocab_size else 0,
            top_p=p.top_p, min_p=p.min_p, seed=req.seed,
            counter=len(req.output_token_ids), repetition_penalty=p.repetition_penalty,
            presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
            prompt_ids=req.prompt_token_ids, output_ids=req.output_token_ids, logit_bias=bias,
            logprobs=p.logprobs is not None, only_biased=bool(p.allowed_token_ids),
            bad_words=p.bad_words_token_ids or (),
        )  # fmt: skip

    def _stop(self, req: Request, token: int, count: int) -> tuple[str | None, int | None]:
        """Why the sequence ends after `token`, its `count`-th output token (None: it goes on)."""
        # Before min_tokens the stop ids carry a -inf bias, so they cannot be sampled here.
        p = req.params
        if token in p.stop_token_ids:
            return "stop", token
        if not p.ignore_eos and token in self.eos_token_ids:
            return "stop", None
        if count >= p.max_tokens or len(req.prompt_token_ids) + count >= self.cc.max_model_len:
            return "length", None
        return None, None

    def step(self) -> list[SeqUpdate]:
        """Runs one step and returns the sequences' new tokens. With overlap, it dispatches the next step first
        and returns the previous step's tokens: the caller's work on them overlaps the device's."""
        return self.finish_step(self.swap_in_flight(self.start_step()))

    def swap_in_flight(self, started: tuple | None) -> tuple | None:
        """The step to collect now: `started` itself, or with overlap the one dispatched before it."""
        if not self.overlap:
            return started
        previous, self._in_flight = self._in_flight, started
        return previous

    def start_step(self) -> tuple | None:
        """Schedules and dispatches one step without waiting for the device (data-parallel replicas start all
        their steps before collecting any). Each sampling sequence gets a placeholder for its token, which the
        device fills in for any step that uses it before the host knows it."""
        host_start = time.perf_counter()
        self._collect_for_grammars()
        batch = self.scheduler.schedule()
        if self.host is not None:
            self._move_kv()
        if not batch:
            return None
        now = time.monotonic()
        chunks, rows, kept = [], [], []
        want_prompt_lp = constrained = False
        for s in batch:
            r = s.req
            if r.status is Status.FINISHED:  # a sibling failed just now
                continue
            try:
                chunk, row = self._prepare(r, s.num_new)
                if r.grammar is not None and s.samples:
                    row.token_mask = r.grammar.mask()
                    constrained = True
            except Exception as e:
                self._fail(r, e)
                continue
            r.first_scheduled_time = r.first_scheduled_time or now
            want_prompt_lp |= chunk.target_ids is not None
            chunks.append(chunk)
            rows.append(row)
            kept.append(s)
        batch = kept
        if not batch:
            return None
        try:
            pending = self.runner.dispatch(chunks, rows, want_prompt_lp, host_start)  # packs before returning
        except Exception as e:
            self._fail_step(batch, e)
            return None
        for i, s in enumerate(batch):
            r = s.req
            n_prompt = len(r.prompt_token_ids)
            prompt_tokens = max(0, min(r.num_computed + s.num_new, n_prompt) - r.num_computed)
            self.num_prefilled_tokens += prompt_tokens
            if prompt_tokens and r.first_token_time is None:  # a prefill chunk (a recompute after preemption: not)
                s.prefill_chunk = [now - r.arrival_time, -1.0, prompt_tokens]
                r.prefill_chunks.append(s.prefill_chunk)
            r.num_computed += s.num_new  # the next step may be scheduled before this one's results are read
            if s.samples:
                s.out_index = len(r.output_token_ids)
                r.output_token_ids.append(placeholder(i))
        return batch, chunks, pending, constrained

    def _collect_for_grammars(self) -> None:
        """With overlap, collects the step in flight now when it samples a constrained sequence: the next mask of
        that sequence follows from the token it samples. Its updates go out with the next step's. (Overlap pauses
        for every sequence of these steps: the grammar's host work waits for the device, as vLLM's does.)"""
        if self._in_flight is not None and self._in_flight[3]:
            started, self._in_flight = self._in_flight, None
            updates = self.finish_step(started)  # it takes what was unreported before, too
            self._unreported.extend(updates)

    def finish_step(self, started: tuple | None) -> list[SeqUpdate]:
        """Collects a dispatched step's tokens and updates every sequence it ran (and reports failed ones)."""
        if self._spills:
            self._store_spills()
        if started is None:
            return self._take_unreported()
        batch, chunks, pending, _ = started
        try:
            out, prompt_lp = self.runner.collect(pending)
        except Exception as e:
            self._fail_step(batch, e)
            return self._take_unreported()
        self.num_steps += 1
        now = time.monotonic()
        updates = []
        off = 0
        for i, (s, chunk) in enumerate(zip(batch, chunks, strict=True)):
            req = s.req
            start, off = off, off + len(chunk.token_ids)
            if s.prefill_chunk is not None:  # with overlap, read after the next step was dispatched
                s.prefill_chunk[1] = now - req.arrival_time
            if req.status is Status.FINISHED:  # ended (stop string, abort, eos) while this step was in flight
                continue
            try:
                if prompt_lp is not None and chunk.target_ids is not None:
                    self._record_prompt_logprobs(req, chunk, prompt_lp, start)
                update = self._update(req, s, out, i, now)
            except Exception as e:
                self._fail(req, e)
                continue
            if update is not None:
                updates.append(update)
        return updates + self._take_unreported()

    def _update(self, req: Request, s, out, i: int, now: float) -> SeqUpdate | None:
        """Row i of a step's outputs applied to its sequence; its SeqUpdate when the row sampled a token."""
        tok = int(out.token_ids[i])
        if s.samples:
            req.output_token_ids[s.out_index] = tok
        self.scheduler.commit(req)
        if not s.samples:
            return None
        self.num_generated_tokens += 1
        lp: list[dict[int, float]] = []
        if req.params.logprobs is not None:
            k = req.params.logprobs
            entry = {tok: float(out.logprobs[i])}
            entry.update({int(t): float(v) for t, v in zip(out.top_ids[i, :k], out.top_logprobs[i, :k], strict=True)})
            req.output_logprobs.append(entry)
            lp = [entry]
        req.first_token_time = req.first_token_time or now
        reason, stop_reason = self._stop(req, tok, s.out_index + 1)
        if req.grammar is not None:
            # A token the grammar refuses ends the request with an error (finish_step). A complete grammar allows
            # only EOS next, which ends the sequence as any EOS does (vLLM's way: EOS is in its tokens), unless
            # ignore_eos: then the grammar, done with that EOS, ends it.
            req.grammar.accept(tok)
            if reason is None and req.grammar.done and tok in self.eos_token_ids:
                reason = "stop"
        if reason:
            self._end(req, reason)
            req.stop_reason, req.finish_time = stop_reason, now
            self.seqs.pop(req.request_id, None)
            self._forget_group(req)
        update = SeqUpdate(req.request_id, [tok], lp, reason is not None, reason, stop_reason)
        if s.out_index == 0:
            update.timing = SeqTiming(
                (req.first_scheduled_time or now) - req.arrival_time, now - req.arrival_time, req.num_cached_tokens,
                req.prefill_chunks, req.num_host_cached_tokens,
            )  # fmt: skip
        if req.params.prompt_logprobs is not None and s.out_index == 0:
            update.prompt_logprobs, update.prompt_ranks = req.prompt_logprobs, req.prompt_ranks
        return update

    def _record_prompt_logprobs(self, req: Request, c: SeqChunk, prompt_lp: tuple, off: int) -> None:
        """The chunk's rows of the step's per-token prompt logprobs (they start at packed token `off`)."""
        lps, top_ids, top_lps, ranks = prompt_lp
        if not req.prompt_logprobs:
            req.prompt_logprobs = [None]  # the first prompt token has nothing before it
            req.prompt_ranks = [None]
        k = req.params.prompt_logprobs
        for j, target in enumerate(c.target_ids):
            # Entry p + 1 scores prompt token p + 1; a preempted request recomputes entries it already has.
            if target < 0 or c.start + j + 1 < len(req.prompt_logprobs):
                continue
            entry = {int(target): float(lps[off + j])}
            for t, v in zip(top_ids[off + j, :k], top_lps[off + j, :k], strict=True):
                entry.setdefault(int(t), float(v))
            req.prompt_logprobs.append(entry)
            req.prompt_ranks.append(int(ranks[off + j]))

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[list[Request]]:
        """Runs token-id prompts to completion; for each prompt, its finished sequences (n of them)."""
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        rids = [self.add_request(p, sp) for p, sp in zip(prompts, plist, strict=True)]
        seqs = {rid: [self.seqs[s] for s in self.groups[rid]] for rid in rids}
        while self.has_unfinished():
            self.step()
        return [seqs[rid] for rid in rids]


def resolved_max_tokens(params: SamplingParams, prompt_len: int, max_model_len: int) -> int:
    """max_tokens, None read as the rest of the context (vLLM's meaning)."""
    return max_model_len - prompt_len if params.max_tokens is None else params.max_tokens


def device_seed(seed: int) -> int:
    """A request's seed as the 32 bits the device samples with: seeds in [0, 2**32) as they are, any other (OpenAI
    takes a signed 64-bit one) mixed down (splitmix64's finalizer), so that nearby large seeds do not collide."""
    if 0 <= seed < 2**32:
        return seed
    return _splitmix64(seed & 0xFFFFFFFFFFFFFFFF) >> 32


def _splitmix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return z ^ (z >> 31)


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of a request seeded `seed` (n > 1): the first sample uses the seed itself (as with
    n = 1); the others a 32-bit mix of (seed, index) (splitmix64's finalizer). vLLM gives sample i `seed + i`, so
    that samples 1..n-1 of seed s are samples 0..n-2 of seed s + 1: a sweep over seeds with n > 1 drew the same
    samples again."""
    if index == 0:
        return seed
    return _splitmix64(((seed << 32) | index) & 0xFFFFFFFFFFFFFFFF) >> 32
