"""A stand-in for `jaxinfer.engine.engine.Engine` with the same interface, for lifecycle tests that need control
the real model cannot give: hold every step, or kill the engine thread on purpose.

It "generates" token ids counting up from the last prompt token (or from `first_token` when set), one per step per
sequence, with logprob -1.0 for each when asked, and needs no jax. Like the real engine it reports each sequence's
timeline (`SeqTiming`) with its first token: its prompt is "prefilled" in chunks of `prefill_chunk` tokens, one
chunk a step, and the last chunk's step makes the first token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from jaxinfer.types import SamplingParams, SeqTiming, SeqUpdate


@dataclass
class _CacheConfig:
    max_model_len: int = 512
    max_logprobs: int = 20


@dataclass
class _Runner:
    num_kv_tokens: int = 4096
    deferred: list = field(default_factory=list)

    def warmup(self, advanced: bool = True, prompt_logprobs: bool = False, progress=None, defer=False) -> float:
        return 0.0

    def compile_deferred(self) -> int:  # as ModelRunner's: one deferred program "compiled" a call
        self.deferred.pop(0)
        return len(self.deferred)


@dataclass
class _Allocator:
    num_pages: int = 256
    num_used: int = 0
    hit_rate: float = 0.0


@dataclass
class _Scheduler:
    running: list = field(default_factory=list)
    waiting: list = field(default_factory=list)


class FakeEngine:
    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.cc = _CacheConfig()
        self.runner = _Runner()
        self.allocator = _Allocator()
        self.scheduler = _Scheduler()
        self.seqs: dict[str, _Seq] = {}
        self.first_token: int | None = None  # every sequence counts up from here instead (chat prompts all end alike)
        self.prompts: dict[str, list[int]] = {}  # request id -> the prompt it was given (what the model "saw")
        # While paused the engine thread idles (no step runs, commands such as aborts still do): requests stay
        # waiting for their first token.
        self.paused = False
        self.fail_next_step = False
        self.prefill_chunk: int | None = None  # prompt tokens per step (None: the whole prompt in one step)
        self.stop_after: int | None = None  # end every sequence with "stop" after this many tokens (as an EOS)
        self.step_delay = 0.0  # seconds each step takes, as a device would
        self.sampling_defaults: dict[str, float | int] = {}  # a model's generation_config.json values, as Engine's

    def largest(self) -> FakeEngine:
        return self  # as Engine's: the engine whose limits a request is checked against

    def cache_stats(self) -> dict[str, float]:
        return {}  # no sessions, no host tier

    def expire_sessions(self) -> None:
        pass

    def release_sessions(self) -> None:
        pass

    def validate(self, prompt_ids, params: SamplingParams) -> list[int]:
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("prompt: needs at least one token")
        if len(prompt) + params.max_tokens > self.cc.max_model_len:
            raise ValueError("max_tokens: prompt + max_tokens exceeds the maximum context length")
        return prompt

    def add_request(self, prompt_ids, params: SamplingParams, request_id: str) -> str:
        sids = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        self.prompts[request_id] = list(prompt_ids)
        for sid in sids:
            start = self.first_token if self.first_token is not None else prompt_ids[-1] + 1
            asked = params.logprobs is not None
            self.seqs[sid] = _Seq(start % self.vocab_size, params.max_tokens, len(prompt_ids), asked)
        self.allocator.num_used += len(sids)
        return request_id

    def _drop(self, sid: str) -> None:
        if self.seqs.pop(sid, None) is not None:
            self.allocator.num_used -= 1

    def abort(self, request_id: str) -> None:
        for sid in [s for s in self.seqs if s == request_id or s.startswith(f"{request_id}#")]:
            self._drop(sid)

    def finish_sequence(self, seq_id: str, reason: str, stop_reason=None) -> None:
        self._drop(seq_id)

    def has_unfinished(self) -> bool:
        return bool(self.seqs) and not self.paused

    def step(self) -> list[SeqUpdate]:
        if self.fail_next_step:
            raise RuntimeError("injected engine failure")
        time.sleep(self.step_delay)
        updates = []
        for sid, seq in list(self.seqs.items()):
            timing = None
            if seq.computed < seq.prompt_len:  # prefill: one chunk this step
                start = time.monotonic() - seq.arrival
                seq.scheduled = start if seq.scheduled is None else seq.scheduled
                n = min(seq.prompt_len - seq.computed, self.prefill_chunk or seq.prompt_len)
                seq.computed += n
                seq.chunks.append([start, time.monotonic() - seq.arrival, n])
                if seq.computed < seq.prompt_len:
                    continue
                now = time.monotonic() - seq.arrival
                timing = SeqTiming(seq.scheduled, now, 0, seq.chunks)
            tok = seq.next
            seq.next, seq.left, seq.made = (tok + 1) % self.vocab_size, seq.left - 1, seq.made + 1
            reason = "length" if seq.left == 0 else "stop" if seq.made == self.stop_after else None
            if reason:
                self._drop(sid)
            lps = [{tok: -1.0}] if seq.logprobs else []
            updates.append(SeqUpdate(sid, [tok], lps, reason is not None, reason, timing=timing))
        return updates


@dataclass
class _Seq:
    next: int  # the next token it makes
    left: int  # tokens before max_tokens
    prompt_len: int
    logprobs: bool  # asked for
    computed: int = 0  # prompt tokens "prefilled"
    made: int = 0
    arrival: float = field(default_factory=time.monotonic)
    scheduled: float | None = None
    chunks: list = field(default_factory=list)
