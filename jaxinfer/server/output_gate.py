"""Generated text through the output filters (jaxinfer.server.filters) before any of it reaches the client.

`OutputGate` screens one engine request's cumulative outputs, every choice (n > 1) on its own: a choice's text is
cut to what the filters passed so far (the rest is held, as the detokenizer holds a possible stop string), and its
tokens and logprobs to those whose text is all shown, so a held or blocked phrase leaks neither through the text
nor through the logprobs' token strings. A blocked choice ends there with finish_reason `content_filter`
(stop_reason: the filter's reason). The filters run on the filter threads, off the event loop and outside the
engine; the same gate serves streamed and whole responses, chat and completions, so they show the same text.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from jaxinfer.server.errors import APIError
from jaxinfer.server.filters import Filters
from jaxinfer.tokenizer import Tokenizer
from jaxinfer.types import CompletionOutput, RequestOutput, SamplingParams

log = logging.getLogger(__name__)

CONTENT_FILTER = "content_filter"
# Prompt tokens decoded before a choice's tokens when mapping a cut in its text back to tokens (as the detokenizer
# does): enough for a sentencepiece leading space to come out as it did in the text.
_CONTEXT_TOKENS = 5

Runner = Callable[..., Awaitable]  # runs fn(*args) on the filter threads


@dataclass
class _Choice:
    released: int = 0  # characters of the text the filters passed
    tokens: int = 0  # tokens whose text is all within the passed text
    final: CompletionOutput | None = None  # what the client gets from now on, once the choice ended


class OutputGate:
    def __init__(self, filters: Filters, tokenizer: Tokenizer, prompt_ids: list[int], params: SamplingParams,
                 run: Runner):  # fmt: skip
        self._filters = filters
        self._tokenizer = tokenizer
        self._context = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._skip_special = params.skip_special_tokens
        self._choices = [_Choice() for _ in range(params.n)]
        self._run = run

    async def screen(self, out: RequestOutput) -> RequestOutput:
        """`out` as the client may see it; `finished` once every choice ended (the filters may end them first).
        A filter that fails ends this request (a 500, or an error event in a stream) with nothing more shown."""
        try:
            return await self._run(self._screen, out)
        except Exception as e:
            log.exception("request %s: a content filter failed", out.request_id)
            raise APIError(500, f"a content filter failed: {type(e).__name__}: {e}", code="filter_error") from e

    def _screen(self, out: RequestOutput) -> RequestOutput:
        outs = [self._choice(c) for c in out.outputs]
        return dataclasses.replace(out, outputs=outs, finished=all(o.finish_reason is not None for o in outs))

    def _choice(self, c: CompletionOutput) -> CompletionOutput:
        st = self._choices[c.index]
        if st.final is not None:
            return st.final
        final = c.finish_reason is not None
        verdict = self._filters.check_output(c.text, st.released, final)
        if verdict.blocked is not None:
            st.released = verdict.release
            st.tokens = self._tokens_within(c.token_ids, st.tokens, st.released)
            st.final = _cut(c, st.released, st.tokens, CONTENT_FILTER, verdict.blocked)
            return st.final
        # A complete text passes whole: a filter holds only what may still grow into a match.
        st.released = len(c.text) if final else verdict.release
        if st.released == len(c.text):
            st.tokens = len(c.token_ids)
        shown = _cut(c, st.released, st.tokens, c.finish_reason, c.stop_reason)
        if final:
            st.final = shown
        return shown

    def _tokens_within(self, token_ids: list[int], lo: int, chars: int) -> int:
        """The most tokens (at least `lo`, known to be within) whose text fits in the first `chars` characters."""

        def length(k: int) -> int:
            return len(self._tokenizer.decode(self._context + token_ids[:k], skip_special_tokens=self._skip_special))

        base = length(0)
        hi = len(token_ids)
        while lo < hi:  # bisection: the decoded text only grows with more tokens
            mid = (lo + hi + 1) // 2
            if length(mid) - base <= chars:
                lo = mid
            else:
                hi = mid - 1
        return lo


def _cut(c: CompletionOutput, chars: int, tokens: int, finish_reason: str | None, stop_reason) -> CompletionOutput:
    logprobs = None if c.logprobs is None else c.logprobs[:tokens]
    cumulative = c.cumulative_logprob
    if logprobs is not None and tokens < len(c.token_ids):
        cumulative = sum(lp.get(t, -math.inf) for t, lp in zip(c.token_ids, logprobs, strict=False))
    return dataclasses.replace(c, text=c.text[:chars], token_ids=c.token_ids[:tokens], logprobs=logprobs,
                               cumulative_logprob=cumulative, finish_reason=finish_reason,
                               stop_reason=stop_reason)  # fmt: skip
