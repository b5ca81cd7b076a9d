"""Token updates -> RequestOutput deltas: detokenization, stop strings and the assembly of n samples per request.

Lives above the engine so that text work can move to another process than the device loop.

Outputs are deltas: each RequestOutput holds, for each sample that moved, only what is new since that sample's
previous output (its new text, token ids and logprobs), so that what waits in a stream's queue is bounded by the
tokens made, never a copy of the whole output per step. A delta may hold tokens without text (text held back: an
unfinished character, a possible stop string); the text comes in a later one. `cumulative_logprob` stays the
running total; a request's `prompt_logprobs` come once, in its first output. `OutputAccumulator` adds deltas up
into the whole output (the server's handlers, `LLM`).

A sequence ended by a stop token (EOS, stop_token_ids) keeps that token in its token ids and logprobs but not its
text, unless include_stop_str_in_output: vLLM's rule, the one stop strings follow too (`_hide_stop_token`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from jaxinfer.detokenizer import IncrementalDetokenizer
from jaxinfer.tokenizer import Tokenizer
from jaxinfer.types import CompletionOutput, RequestMetrics, RequestOutput, SamplingParams, SeqTiming, SeqUpdate

# Ends a sequence the engine still runs: (seq id, finish reason, stop reason), as Engine.finish_sequence takes them.
Finish = Callable[[str, str, int | str | None], None]


@dataclass
class _Seq:
    index: int
    detok: IncrementalDetokenizer
    num_tokens: int = 0
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_finish: bool = False  # the output that said it finished went out
    # Not sent yet: new tokens (and their logprobs), and new text that became final.
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    text: list[str] = field(default_factory=list)

    def has_news(self) -> bool:
        return bool(self.token_ids) or bool(self.text) or (self.finish_reason is not None and not self.sent_finish)


@dataclass
class _Req:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: dict[str, _Seq]
    arrival_time: float  # when it was handed to the engine (time.monotonic)
    prompt_logprobs: list | None = None
    prompt_ranks: list | None = None
    sent_prompt_logprobs: bool = False
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
                # min_tokens: a stop string may end only after it (as vLLM v1), from the first token past it.
                # detokenize=False: nothing is decoded, nor the prompt's tail as context.
                self.tokenizer, prompt_ids if params.detokenize else [], skip_special_tokens=params.skip_special_tokens,
                stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output, stop_armed=params.min_tokens == 0,
            )  # fmt: skip
            seqs[sid] = _Seq(i, detok)
            self._seq_owner[sid] = request_id
        self._reqs[request_id] = _Req(request_id, prompt, prompt_ids, params, seqs, time.monotonic())

    def forget(self, request_id: str) -> None:
        req = self._reqs.pop(request_id, None)
        for sid in req.seqs if req else ():
            self._seq_owner.pop(sid, None)

    def process(self, updates: list[SeqUpdate], finish: Finish) -> list[RequestOutput]:
        """The output loop of every front (LLM, AsyncEngine, the engine-process client): a delta RequestOutput for
        each request with news. A sequence whose stop string is found here, while the engine still runs it, is
        ended through `finish(seq_id, "stop", stop_string)` (Engine.finish_sequence, or a command to the core)."""
        touched: dict[str, _Req] = {}
        for u in updates:
            rid = self._seq_owner.get(u.request_id)
            if rid is None:
                continue
            req = self._reqs[rid]
            seq = req.seqs[u.request_id]
            if seq.finish_reason is not None:  # tokens made before the engine heard of a stop string found here
                continue
            touched[rid] = req
            if u.error is not None:  # the engine failed the request: every sample ends with it
                req.error = u.error
                for other in req.seqs.values():
                    other.finish_reason = other.finish_reason or "error"
                continue
            if u.prompt_logprobs is not None and req.prompt_logprobs is None:
                req.prompt_logprobs, req.prompt_ranks = u.prompt_logprobs, u.prompt_ranks
            if u.timing is not None and req.timing is None:
                req.timing = u.timing
            t0 = time.perf_counter()
            # The token that ended the sequence by itself (EOS, stop_token_ids) is the last one of the update.
            unrendered = len(u.new_token_ids) - 1 if _hide_stop_token(u, req.params) else -1
            for j, (tok, lp) in enumerate(
                zip(u.new_token_ids, u.new_logprobs or [None] * len(u.new_token_ids), strict=True)
            ):
                if seq.detok.stopped:
                    break  # past the stop string: not part of the output
                if seq.num_tokens == req.params.min_tokens > 0:
                    seq.detok.arm_stop()
                seq.num_tokens += 1
                seq.token_ids.append(tok)
                if j != unrendered and req.params.detokenize and (text := seq.detok.add(tok)):
                    seq.text.append(text)
                if lp is not None:
                    seq.logprobs.append(lp)
                    seq.cumulative_logprob += lp.get(tok, -math.inf)
            if seq.detok.stopped:
                seq.finish_reason, seq.stop_reason = "stop", seq.detok.stop_reason
                if not u.finished:
                    finish(u.request_id, "stop", seq.detok.stop_reason)
            elif u.finished:
                if req.params.detokenize and (text := seq.detok.flush()):
                    seq.text.append(text)
                seq.finish_reason, seq.stop_reason = u.finish_reason, u.stop_reason
            req.detokenize_s += time.perf_counter() - t0
        outs = [out for req in touched.values() if (out := self._output(req)) is not None]
        for out in outs:
            if out.finished:
                self.forget(out.request_id)
        return outs

    def abort(self, request_id: str) -> RequestOutput | None:
        """The request's last output (finish_reason "abort" for every sample still going), and forgets it."""
        req = self._reqs.get(request_id)
        if req is None:
            return None
        for seq in req.seqs.values():
            if seq.finish_reason is None:
                seq.finish_reason = "abort"
        out = self._output(req)
        self.forget(request_id)
        return out

    def _output(self, req: _Req) -> RequestOutput | None:
        """What is new for the request's samples since their previous output (None: nothing is)."""
        want_lp = req.params.logprobs is not None
        outs = []
        for s in req.seqs.values():
            if not s.has_news():
                continue
            outs.append(CompletionOutput(
                s.index, "".join(s.text), s.token_ids, s.cumulative_logprob if want_lp else None,
                s.logprobs if want_lp else None, s.finish_reason, s.stop_reason,
            ))  # fmt: skip
            s.text, s.token_ids, s.logprobs = [], [], []
            s.sent_finish = s.finish_reason is not None
        if not outs:
            return None
        finished = all(s.sent_finish for s in req.seqs.values())
        if finished and req.finished_time is None:
            req.finished_time = time.monotonic()
        prompt_logprobs = prompt_ranks = None
        if req.prompt_logprobs is not None and not req.sent_prompt_logprobs:
            prompt_logprobs, prompt_ranks, req.sent_prompt_logprobs = req.prompt_logprobs, req.prompt_ranks, True
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, prompt_logprobs, outs, finished,
                             self._metrics(req), req.error, prompt_ranks)  # fmt: skip

    @staticmethod
    def _metrics(req: _Req) -> RequestMetrics:
        """The engine's offsets placed on this process's clock, from the arrival recorded in `add`."""
        t, a = req.timing, req.arrival_time
        if t is None:
            return RequestMetrics(a, None, None, req.finished_time, detokenize_s=req.detokenize_s)
        chunks = [(a + start, a + done, int(tokens)) for start, done, tokens in t.prefill_chunks]
        return RequestMetrics(a, a + t.queued_s, a + t.first_token_s, req.finished_time, t.num_cached_tokens,
                              t.num_host_cached_tokens, chunks, req.detokenize_s)  # fmt: skip


def _hide_stop_token(u: SeqUpdate, params: SamplingParams) -> bool:
    """Whether the update's last token ended its sequence as a stop token whose text stays out of the output.

    vLLM's rule (v1 IncrementalDetokenizer.update with stop_terminated): a sequence that sampled EOS or one of
    stop_token_ids does not show that token's text (e.g. "<|im_end|>" with skip_special_tokens=False, or "." as a
    stop token) unless include_stop_str_in_output, as a stop string does not show. The token itself stays: in
    token_ids, usage, and the logprobs, as vLLM keeps it in its logprobs too (the model did sample it, and a
    client scoring the output needs its logprob). The engine ends a sequence with "stop" only on a stop token: its
    stop_reason is the token id, or None for EOS; stop strings (a str) are found here, before the engine hears.
    """
    return (
        u.finished and u.finish_reason == "stop" and not isinstance(u.stop_reason, str)
        and not params.include_stop_str_in_output and bool(u.new_token_ids)
    )  # fmt: skip


class OutputAccumulator:
    """A request's deltas (from `OutputProcessor`, or an engine front's stream) added up into its whole output."""

    def __init__(self, params: SamplingParams | None = None):
        """With `params`, the whole output lists all n samples from the start (those without output yet empty),
        as a caller that decides "every sample ended" must see them; without, only the samples seen."""
        self._last: RequestOutput | None = None
        self._prompt_logprobs: list | None = None
        self._prompt_ranks: list | None = None
        self._samples: dict[int, _Whole] = {}
        for i in range(params.n if params is not None else 0):
            self._samples[i] = _Whole(i, [] if params.logprobs is not None else None)

    def add(self, delta: RequestOutput) -> None:
        self._last = delta
        if delta.prompt_logprobs is not None:
            self._prompt_logprobs, self._prompt_ranks = delta.prompt_logprobs, delta.prompt_ranks
        for c in delta.outputs:
            whole = self._samples.get(c.index)
            if whole is None:
                whole = self._samples[c.index] = _Whole(c.index, [] if c.logprobs is not None else None)
            whole.text.append(c.text)
            whole.token_ids.extend(c.token_ids)
            if c.logprobs is not None and whole.logprobs is not None:
                whole.logprobs.extend(c.logprobs)
            whole.cumulative_logprob = c.cumulative_logprob
            whole.finish_reason, whole.stop_reason = c.finish_reason, c.stop_reason

    def result(self) -> RequestOutput | None:
        """The whole output so far (None before the first delta): new objects, which later deltas leave alone."""
        if self._last is None:
            return None
        outs = [self._samples[i].output() for i in sorted(self._samples)]
        last = self._last
        return RequestOutput(last.request_id, last.prompt, last.prompt_token_ids, self._prompt_logprobs, outs,
                             last.finished, last.metrics, last.error, self._prompt_ranks)  # fmt: skip


@dataclass
class _Whole:
    index: int
    logprobs: list[dict[int, float]] | None
    text: list[str] = field(default_factory=list)  # parts, joined when asked for
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def output(self) -> CompletionOutput:
        if len(self.text) > 1:
            self.text[:] = ["".join(self.text)]
        cumulative = self.cumulative_logprob
        if cumulative is None and self.logprobs is not None:
            cumulative = 0.0
        return CompletionOutput(self.index, self.text[0] if self.text else "", list(self.token_ids), cumulative,
                                list(self.logprobs) if self.logprobs is not None else None, self.finish_reason,
                                self.stop_reason)  # fmt: skip
