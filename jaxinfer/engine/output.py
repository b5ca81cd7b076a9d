"""Token updates -> RequestOutputs: detokenization, stop strings and the assembly of n samples per request.

Lives above the engine so that text work can move to another process than the device loop.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from jaxinfer.detokenizer import IncrementalDetokenizer
from jaxinfer.tokenizer import Tokenizer
from jaxinfer.types import CompletionOutput, RequestMetrics, RequestOutput, SamplingParams, SeqTiming, SeqUpdate


@dataclass
class _Seq:
    index: int
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class _Req:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: dict[str, _Seq]
    arrival_time: float  # when it was handed to the engine (time.monotonic)
    prompt_logprobs: list | None = None
    error: str | None = None  # the engine failed it (finish_reason "error")
    timing: SeqTiming | None = None  # the first sample's to reach its first token
    detokenize_s: float = 0.0
    finished_time: float | None = None


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._reqs: dict[str, _Req] = {}
        self._seq_owner: dict[str, str] = {}

    def add(self, request_id: str, prompt: str | None, prompt_ids: list[int], params: SamplingParams) -> None:
        """Called as the request is handed to the engine: its arrival time, which the engine's offsets count from."""
        sids = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        seqs = {}
        for i, sid in enumerate(sids):
            detok = IncrementalDetokenizer(
                # min_tokens: stop strings are checked only after it (as vLLM v1), from the first token past it.
                self.tokenizer, prompt_ids, skip_special_tokens=params.skip_special_tokens,
                stop=params.stop if params.min_tokens == 0 else (),
                include_stop_str_in_output=params.include_stop_str_in_output,
            )  # fmt: skip
            seqs[sid] = _Seq(i, detok)
            self._seq_owner[sid] = request_id
        self._reqs[request_id] = _Req(request_id, prompt, prompt_ids, params, seqs, time.monotonic())

    def forget(self, request_id: str) -> None:
        req = self._reqs.pop(request_id, None)
        for sid in req.seqs if req else ():
            self._seq_owner.pop(sid, None)

    def process(self, updates: list[SeqUpdate]) -> tuple[list[RequestOutput], list[tuple[str, int | str]]]:
        """Returns (a cumulative RequestOutput for each touched request, sequences to stop: (seq id, stop string))."""
        touched: dict[str, _Req] = {}
        to_stop: list[tuple[str, int | str]] = []
        for u in updates:
            rid = self._seq_owner.get(u.request_id)
            if rid is None:
                continue
            req = self._reqs[rid]
            seq = req.seqs[u.request_id]
            touched[rid] = req
            if u.error is not None:  # the engine failed the request: every sample ends with it
                req.error = u.error
                for other in req.seqs.values():
                    other.finish_reason = other.finish_reason or "error"
                continue
            if u.prompt_logprobs is not None and req.prompt_logprobs is None:
                req.prompt_logprobs = u.prompt_logprobs
            if u.timing is not None and req.timing is None:
                req.timing = u.timing
            t0 = time.perf_counter()
            for tok, lp in zip(u.new_token_ids, u.new_logprobs or [None] * len(u.new_token_ids), strict=True):
                if len(seq.token_ids) == req.params.min_tokens > 0:
                    seq.detok.arm_stop(req.params.stop)
                seq.token_ids.append(tok)
                seq.detok.add(tok)
                if lp is not None:
                    seq.logprobs.append(lp)
                    seq.cumulative_logprob += lp.get(tok, -math.inf)
            if seq.detok.stopped and seq.finish_reason is None:
                seq.finish_reason, seq.stop_reason = "stop", seq.detok.stop_reason
                if not u.finished:
                    to_stop.append((u.request_id, seq.detok.stop_reason))
            elif u.finished and seq.finish_reason is None:
                seq.detok.flush()
                seq.finish_reason, seq.stop_reason = u.finish_reason, u.stop_reason
            req.detokenize_s += time.perf_counter() - t0
        outs = [self._output(req) for req in touched.values()]
        for out in outs:
            if out.finished:
                self.forget(out.request_id)
        return outs, to_stop

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self._reqs.get(request_id)
        if req is None:
            return None
        for seq in req.seqs.values():
            if seq.finish_reason is None:
                seq.finish_reason = "abort"
        out = self._output(req)
        self.forget(request_id)
        return out

    def _output(self, req: _Req) -> RequestOutput:
        want_lp = req.params.logprobs is not None
        outs = [
            CompletionOutput(
                s.index,
                s.detok.text,
                list(s.token_ids),
                s.cumulative_logprob if want_lp else None,
                list(s.logprobs) if want_lp else None,
                s.finish_reason,
                s.stop_reason,
            )  # fmt: skip
            for s in req.seqs.values()
        ]
        finished = all(o.finish_reason is not None for o in outs)
        if finished and req.finished_time is None:
            req.finished_time = time.monotonic()
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, req.prompt_logprobs, outs, finished,
                             self._metrics(req), req.error)  # fmt: skip

    @staticmethod
    def _metrics(req: _Req) -> RequestMetrics:
        """The engine's offsets placed on this process's clock, from the arrival recorded in `add`."""
        t, a = req.timing, req.arrival_time
        if t is None:
            return RequestMetrics(a, None, None, req.finished_time, detokenize_s=req.detokenize_s)
        chunks = [(a + start, a + done, int(tokens)) for start, done, tokens in t.prefill_chunks]
        return RequestMetrics(a, a + t.queued_s, a + t.first_token_s, req.finished_time, t.num_cached_tokens,
                              t.num_host_cached_tokens, chunks, req.detokenize_s)  # fmt: skip
