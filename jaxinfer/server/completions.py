"""POST /v1/completions: text or token-id prompts (one or several), echo, legacy logprobs, streaming."""

from __future__ import annotations

import bisect
import dataclasses
import time
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from jaxinfer.server.admission import Admission
from jaxinfer.server.body import parse_request
from jaxinfer.server.context import ServingContext, request_id, session_id
from jaxinfer.server.errors import APIError, bad_request, from_value_error
from jaxinfer.server.generation import EngineRequest, final_output, run_request, usage
from jaxinfer.server.logprobs import TextOffsets, TokenIds, completion_logprobs, join_logprobs, prompt_logprobs
from jaxinfer.server.protocol import CompletionRequest
from jaxinfer.server.sampling import check_fanout, completion_params, prompt_only, reject_unsupported
from jaxinfer.server.streaming import (
    SSE_DONE,
    ClientDisconnected,
    TrackedStream,
    cancel_on_disconnect,
    gather_all,
    merge,
    sse,
)
from jaxinfer.server.truncation import completion_room, keep_last_tokens, refuse_surely_too_long
from jaxinfer.types import CompletionOutput, RequestOutput, with_bad_words_ids


def _prompts(req: CompletionRequest, ctx: ServingContext) -> list[tuple[str | None, list[int]]]:
    """(text or None, token ids) for each prompt."""
    p = req.prompt
    if isinstance(p, str):
        items: list = [p]
    elif p and all(isinstance(x, int) for x in p):
        items = [p]  # one prompt as token ids
    else:
        items = list(p)
    if not items:
        raise bad_request("prompt must not be empty", "prompt")
    if len(items) > ctx.args.max_prompts:
        raise bad_request(f"prompt: at most {ctx.args.max_prompts} prompts per request (--max-prompts), got "
                          f"{len(items)}", "prompt")  # fmt: skip
    out = []
    for item in items:
        if not item:
            raise bad_request("prompt must not be empty", "prompt")
        if isinstance(item, str):
            if req.truncate_prompt_tokens is None:  # truncated, a text of any length may fit
                refuse_surely_too_long(ctx.tokenizer, item, ctx.context_tokens, "prompt")
            out.append((item, ctx.tokenizer.encode(item, add_special_tokens=req.add_special_tokens)))
        else:
            out.append((None, list(item)))
    return out


def _engine_requests(
    ctx: ServingContext, req: CompletionRequest, engine, prefix: str, session: str | None
) -> list[EngineRequest]:
    """Tokenizes every prompt, and puts it through the input filters, the context-window rule and validation (on the
    thread pool: large prompts take a while). A session follows one conversation: with several prompts none of them
    keeps its pages."""
    if req.max_tokens == 0 and not req.echo:
        raise bad_request("max_tokens must be >= 1 (0 only with echo, which returns the scored prompt)", "max_tokens")
    limit = ctx.context_tokens
    need = completion_room(1 if prompt_only(req) else req.max_tokens, limit, "max_tokens")
    subs = []
    prompts = _prompts(req, ctx)
    for i, (text, ids) in enumerate(prompts):
        # Token-id prompts are checked as the text they decode to: filters cannot be bypassed by sending ids.
        if ctx.filters is not None:
            param = f"prompt.{i}" if len(prompts) > 1 else "prompt"
            ctx.check_input(text if text is not None else ctx.tokenizer.decode(ids), param)
        kept, truncation = keep_last_tokens(ids, req.truncate_prompt_tokens, need, limit, "prompt")
        if len(kept) < len(ids):
            text = None  # echo and the output show the tokens the model saw
        params = completion_params(req, len(kept), limit, engine.sampling_defaults)
        params = dataclasses.replace(params, session_id=session if len(prompts) == 1 else None)
        params = with_bad_words_ids(params, ctx.tokenizer)  # the engine takes them as token ids
        try:
            kept = engine.validate(kept, params)
        except ValueError as e:
            raise from_value_error(e) from None
        scoring = prompt_only(req)
        gate = None if scoring else ctx.output_gate(kept, params)  # prompt only: no generated text shown
        subs.append(EngineRequest(f"{prefix}-{i}", text, kept, params, truncation, gate, scoring))
    return subs


async def create_completion(ctx: ServingContext, request: Request) -> Response:
    req = await parse_request(request, CompletionRequest, ctx.args.max_body_bytes, ctx.off_loop, ctx.state.body_reads)
    engine = ctx.state.require_ready()
    model = ctx.model_name(req.model)
    reject_unsupported(req)
    check_fanout(req, ctx.args)
    rid, prefix = request_id(request, "cmpl")
    subs = await ctx.off_loop(_engine_requests, ctx, req, engine, prefix, session_id(request, req.user))
    admission = ctx.admit(request, rid, model, subs, req.stream)
    view = _View(ctx, req, subs, rid, model)
    if req.stream:
        return TrackedStream(view.stream(admission), admission, ctx.args.stream_stall_timeout)
    try:
        finals = await cancel_on_disconnect(
            request, gather_all([final_output(ctx.state, ctx.metrics, s, admission, i) for i, s in enumerate(subs)])
        )
    except ClientDisconnected:
        admission.failed(499, "client_disconnected")
        return Response(status_code=499)  # nobody reads it; nginx's code for "client closed request"
    finally:
        admission.release()
    return await ctx.json_response(lambda: view.response(finals), admission.headers())


class _View:
    """Engine outputs -> OpenAI's text_completion objects. Choice index = prompt index * n + sample index."""

    def __init__(self, ctx: ServingContext, req: CompletionRequest, subs: list[EngineRequest], rid: str, model: str):
        self.ctx, self.req, self.subs, self.rid, self.model = ctx, req, subs, rid, model
        self.created = int(time.time())
        self.n = req.n
        self.token_text = TokenIds() if req.return_tokens_as_token_ids else ctx.token_text  # logprobs' tokens

    def _echo(self, sub: EngineRequest) -> str:
        if not self.req.echo:
            return ""
        return sub.prompt if sub.prompt is not None else self.ctx.tokenizer.decode(sub.prompt_ids, False)

    def _offsets(self, sub: EngineRequest) -> TextOffsets | None:
        """Places a choice's tokens in its text (text_offset), detokenized as the engine's output path did; None
        without logprobs, where nothing reads offsets (a detokenizer over the prompt would be wasted work)."""
        if self.req.logprobs is None:
            return None
        return TextOffsets(self.ctx.tokenizer, sub.prompt_ids, sub.params.skip_special_tokens)

    @property
    def _scores_prompt(self) -> bool:
        """echo with logprobs: the choice's logprobs cover the echoed prompt tokens first (OpenAI, vLLM)."""
        return self.req.echo and self.req.logprobs is not None

    def _sendable(self, c: CompletionOutput, offsets: TextOffsets | None) -> int:
        """How many of a streamed choice's tokens may go out: all once it ended; before that, with logprobs, those
        whose text starts within the text out so far. A later token's place is not known yet: text held back for a
        possible stop string may still be cut before it, and the text out so far is never taken back."""
        if offsets is None or c.finish_reason is not None:
            return len(c.token_ids)
        offsets.extend(c.token_ids)
        return bisect.bisect_right(offsets.starts, len(c.text))

    def _choice_logprobs(
        self, sub: EngineRequest, out: RequestOutput, c: CompletionOutput, offsets: TextOffsets | None, start: int,
        stop: int, echoed: bool,
    ) -> dict | None:  # fmt: skip
        """Logprobs of the choice's tokens [start, stop), offsets in echo + text; when `echoed`, the echoed
        prompt's tokens come first: the first one unscored (None), the others as the engine scored them given the
        tokens before them."""
        if offsets is None:  # no logprobs asked for
            return None
        echo = self._echo(sub)
        offsets.extend(c.token_ids)
        at = offsets.clamped(start, stop, len(c.text), len(echo))
        entries = (c.logprobs or [])[start:stop]
        gen = completion_logprobs(c.token_ids[start:stop], entries, self.req.logprobs, self.token_text, at)
        if not (echoed and self._scores_prompt):
            return gen
        ids = sub.prompt_ids
        scored = list(out.prompt_logprobs or [])[: len(ids)]
        scored += [None] * (len(ids) - len(scored))  # never short in practice; an unscored token shows None
        prompt = completion_logprobs(ids, scored, self.req.logprobs, self.token_text, self._echo_offsets(sub, echo))
        return join_logprobs(prompt, gen)

    def _prompt_logprobs(self, sub: EngineRequest, out: RequestOutput) -> dict:
        """{"prompt_logprobs": [...]} for each choice of the prompt when asked for (vLLM's field), else {}."""
        k = self.req.prompt_logprobs
        if k is None:
            return {}
        return {"prompt_logprobs": prompt_logprobs(sub.prompt_ids, out.prompt_logprobs, out.prompt_ranks, k,
                                                   self.ctx.token_text)}  # fmt: skip

    def _echo_offsets(self, sub: EngineRequest, echo: str) -> list[int]:
        """Where each prompt token starts in the echoed prompt. Token ids echo as they decode, special tokens kept;
        a text prompt echoes as sent, without the special tokens the tokenizer added to it (a BOS): when the ids
        with their special tokens do not decode to it, they are placed without them."""
        ids = sub.prompt_ids
        keep = sub.prompt is None or self.ctx.tokenizer.decode(ids, skip_special_tokens=False) == echo
        offsets = TextOffsets(self.ctx.tokenizer, [], skip_special_tokens=not keep)
        offsets.extend(ids)
        return offsets.clamped(0, len(ids), len(echo), 0)

    def _usage(self, completion_tokens: int, outs: list[RequestOutput | None]) -> dict:
        return usage(self.subs, completion_tokens, outs)

    def _envelope(self, choices: list[dict]) -> dict:
        return {"id": self.rid, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": choices}  # fmt: skip

    def response(self, finals: list[RequestOutput]) -> dict:
        choices = []
        for i, (sub, out) in enumerate(zip(self.subs, finals, strict=True)):
            echo = self._echo(sub)
            scored = self._prompt_logprobs(sub, out)
            for c in out.outputs:
                choices.append({
                    "index": i * self.n + c.index,
                    "text": echo + c.text,
                    "logprobs": self._choice_logprobs(sub, out, c, self._offsets(sub), 0, len(c.token_ids), True),
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                    **scored,
                })  # fmt: skip
        body = self._envelope(choices)
        body["usage"] = self._usage(sum(len(c.token_ids) for out in finals for c in out.outputs), finals)
        return body

    async def stream(self, admission: Admission) -> AsyncIterator[str]:
        options = self.req.stream_options
        include_usage = bool(options and options.include_usage)
        continuous = bool(options and options.continuous)
        sent_chars: dict[int, int] = {}  # choice index -> characters of its text already sent (echo excluded)
        sent_tokens: dict[int, int] = {}
        offsets: dict[int, TextOffsets | None] = {}  # choice index -> where its tokens start in its text
        finished: set[int] = set()
        streams = [run_request(self.ctx.state, self.ctx.metrics, s, admission, i) for i, s in enumerate(self.subs)]
        last: list[RequestOutput | None] = [None] * len(self.subs)
        try:
            async for i, out in merge(streams):
                last[i] = out
                for c in out.outputs:
                    idx = i * self.n + c.index
                    if idx in finished:
                        continue
                    first = idx not in sent_chars
                    if first and self._scores_prompt and out.prompt_logprobs is None and c.finish_reason is None:
                        continue  # the echo goes out with its logprobs, which come with the first token
                    sub = self.subs[i]
                    prefix = self._echo(sub) if first else ""
                    a, t = sent_chars.get(idx, 0), sent_tokens.get(idx, 0)
                    delta = prefix + c.text[a:]
                    if not delta and c.finish_reason is None:
                        continue  # text held back (an unfinished character or a possible stop string)
                    if idx not in offsets:
                        offsets[idx] = self._offsets(sub)
                    stop = self._sendable(c, offsets[idx])
                    choice = {
                        "index": idx,
                        "text": delta,
                        "logprobs": self._choice_logprobs(sub, out, c, offsets[idx], t, stop, first),
                        "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason,
                    }
                    sent_chars[idx], sent_tokens[idx] = len(c.text), stop
                    if c.finish_reason is not None:
                        finished.add(idx)
                    chunk = self._envelope([choice])
                    if include_usage:
                        chunk["usage"] = self._usage(sum(sent_tokens.values()), last) if continuous else None
                    yield sse(chunk)
            if include_usage:
                chunk = self._envelope([])
                chunk["usage"] = self._usage(sum(sent_tokens.values()), last)
                yield sse(chunk)
        except APIError as e:  # the engine died mid-stream: the status line is sent already, so say it in-band
            yield sse(e.body())
        yield SSE_DONE
