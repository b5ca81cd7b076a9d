"""POST /v1/chat/completions: messages through the model's chat template, chat logprobs, streaming."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

import jinja2
from starlette.requests import Request
from starlette.responses import Response

from jaxinfer.server import tool_parsers
from jaxinfer.server.admission import Admission
from jaxinfer.server.body import parse_request
from jaxinfer.server.context import ServingContext, request_id, session_id
from jaxinfer.server.errors import APIError, bad_request, from_value_error
from jaxinfer.server.generation import EngineRequest, final_output, run_request, usage
from jaxinfer.server.logprobs import TokenIds, chat_logprobs, prompt_logprobs
from jaxinfer.server.protocol import ChatCompletionRequest, ChatMessage, template_kwargs
from jaxinfer.server.sampling import chat_params, check_fanout, reject_unsupported
from jaxinfer.server.streaming import SSE_DONE, ClientDisconnected, TrackedStream, cancel_on_disconnect, merge, sse
from jaxinfer.server.tools import ToolChoice, history_message, required_calls, tool_call, tool_calls, tool_choice
from jaxinfer.server.truncation import check_fits, completion_room, drop_oldest_turns, refuse_surely_too_long
from jaxinfer.tokenizer import ChatTemplateError, Tokenizer, template_role
from jaxinfer.types import RequestOutput, with_bad_words_ids


def chat_messages(messages: list[ChatMessage]) -> list[dict]:
    """The messages as the chat template takes them; 400 naming a message that is not text."""
    if not messages:
        raise bad_request("messages must hold at least one message", "messages")
    convo = []
    for i, m in enumerate(messages):
        if m.role == "function":
            raise bad_request(f"messages.{i}.role: 'function' messages (the deprecated form of a tool's result) are "
                              "not supported: send a 'tool' message", f"messages.{i}.role",
                              "unsupported_parameter")  # fmt: skip
        for name in m.unsupported_fields():
            raise bad_request(f"messages.{i}.{name} is not supported by this server", f"messages.{i}.{name}",
                              "unsupported_parameter")  # fmt: skip
        try:
            content = m.text()
        except ValueError as e:
            raise bad_request(f"messages.{i}.content: {e}", f"messages.{i}.content", "unsupported_parameter") from None
        msg = {"role": template_role(m.role), "content": content}
        if m.name is not None:
            msg["name"] = m.name
        convo.append(history_message(msg, m.tool_calls, m.tool_call_id))
    return convo


def apply_template(tokenizer: Tokenizer, convo: list[dict], kwargs: dict[str, Any]) -> str:
    """`kwargs`: the template's flags and variables (`protocol.template_kwargs`)."""
    try:
        return tokenizer.apply_chat_template(convo, **kwargs)
    except (ChatTemplateError, jinja2.TemplateError) as e:
        raise bad_request(f"messages: the chat template refused them: {e}", "messages") from None
    except ValueError as e:  # a variable named messages; continue_final_message with add_generation_prompt, or
        # without a text to continue (the tokenizer's own checks)
        raise bad_request(
            str(e), "chat_template_kwargs" if "messages" in kwargs else "continue_final_message"
        ) from None


def render_chat(tokenizer: Tokenizer, messages: list[ChatMessage], kwargs: dict[str, Any]) -> str:
    return apply_template(tokenizer, chat_messages(messages), kwargs)


def _engine_request(
    ctx: ServingContext, req: ChatCompletionRequest, engine, rid: str, session: str | None, tools: ToolChoice | None
) -> EngineRequest:
    """Input filters, chat template, tokenization, the context-window rule and validation (on the thread pool: long
    conversations take a while)."""
    convo = chat_messages(req.messages)
    for i, m in enumerate(convo):
        ctx.check_input(m["content"], f"messages.{i}.content")
    limit = ctx.context_tokens
    asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    need = completion_room(asked, limit, "max_tokens" if req.max_completion_tokens is None else "max_completion_tokens")

    kwargs = template_kwargs(req)

    def encode(msgs: list[dict]) -> tuple[str, list[int]]:
        text = apply_template(ctx.tokenizer, msgs, kwargs)
        return text, ctx.tokenizer.encode(text, add_special_tokens=False)  # the template wrote BOS where wanted

    truncation = None
    if ctx.args.chat_truncation == "oldest":
        (text, ids), truncation = drop_oldest_turns(convo, encode, lambda e: len(e[1]), need, limit)
    else:
        refuse_surely_too_long(ctx.tokenizer, "".join(m["content"] for m in convo), limit, "messages")
        text, ids = encode(convo)
        check_fits(len(ids), need, limit, "messages")
    params, renames = chat_params(req, len(ids), limit, engine.sampling_defaults, tools and tools.constraint)
    params = with_bad_words_ids(dataclasses.replace(params, session_id=session), ctx.tokenizer)  # as token ids
    try:
        ids = engine.validate(ids, params)
    except ValueError as e:
        raise from_value_error(e, renames) from None
    return EngineRequest(rid, text, ids, params, truncation, ctx.output_gate(ids, params))


async def create_chat_completion(ctx: ServingContext, request: Request) -> Response:
    req = await parse_request(
        request, ChatCompletionRequest, ctx.args.max_body_bytes, ctx.off_loop, ctx.state.body_reads
    )
    engine = ctx.state.require_ready()
    model = ctx.model_name(req.model)
    reject_unsupported(req)
    check_fanout(req, ctx.args)
    rid, engine_id = request_id(request, "chatcmpl")
    tools = tool_choice(req, ctx.tool_parser)
    sub = await ctx.off_loop(_engine_request, ctx, req, engine, engine_id, session_id(request, req.user), tools)
    admission = ctx.admit(request, rid, model, [sub], req.stream)
    view = _View(ctx, req, sub, model, rid, tools)
    if req.stream:
        return TrackedStream(view.stream(admission), admission, ctx.args.stream_stall_timeout)
    try:
        final = await cancel_on_disconnect(request, final_output(ctx.state, ctx.metrics, sub, admission, 0))
    except ClientDisconnected:
        admission.failed(499, "client_disconnected")
        return Response(status_code=499)
    finally:
        admission.release()
    return await ctx.json_response(lambda: view.response(final), admission.headers())


class _View:
    """Engine outputs -> OpenAI's chat.completion / chat.completion.chunk objects."""

    def __init__(self, ctx: ServingContext, req: ChatCompletionRequest, sub: EngineRequest, model: str, rid: str,
                 tools: ToolChoice | None = None):  # fmt: skip
        self.ctx, self.req, self.sub, self.model, self.rid, self.tools = ctx, req, sub, model, rid, tools
        self.created = int(time.time())

    def _message(self, text: str) -> dict:
        """A whole answer: its text, or the tool calls it holds (tool_choice), beside the text before them ("auto");
        text that is not a whole call (cut short by max_tokens) stays the content."""
        if self.tools is None:
            return {"role": "assistant", "content": text}
        content, calls = tool_calls(self.tools, text)
        return {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}

    def _finish_reason(self, reason: str | None, message: dict) -> str | None:
        """OpenAI's and vLLM's: "tool_calls" when the model chose to call ("auto"); a call that was required ends
        as the output did."""
        auto = self.tools is not None and self.tools.parser is not None
        return "tool_calls" if auto and reason == "stop" and "tool_calls" in message else reason

    def _delta(self, i: int, text: str, sent: int, finished: bool) -> tuple[dict | None, int]:
        """Choice i's next stream delta, from its text so far of which `sent` characters went out: (delta or None to
        hold everything back, characters out after it). A named function's arguments stream as they come, its name
        and call id with the first; "required" calls each as its object closes in the JSON array; "auto" streams
        the text before a call and the calls whole at the end."""
        new = text[sent:]
        if self.tools is None:
            return ({"content": new} if new else {}), len(text)
        if self.tools.function is not None:
            if not new:
                return {}, len(text)
            if not sent:  # the first of the arguments: the call's id and name go with it
                return {"tool_calls": [{"index": 0, **tool_call(self.tools.function, new)}]}, len(text)
            return {"tool_calls": [{"index": 0, "function": {"arguments": new}}]}, len(text)
        if self.tools.parser is None:  # "required"
            calls = required_calls(text)
            fresh, self._calls_out[i] = calls[self._calls_out[i] :], len(calls)
            if fresh:
                first = len(calls) - len(fresh)
                return {"tool_calls": [{"index": first + k, **tool_call(*c)} for k, c in enumerate(fresh)]}, sent
            if not finished:
                return None, sent
            return ({"content": text} if not calls and text else {}), len(text)
        if not finished:
            cut = tool_parsers.PARSERS[self.tools.parser].sendable(text)
            return ({"content": text[sent:cut]}, cut) if cut > sent else (None, sent)
        whole = self._message(text)
        if "tool_calls" not in whole:
            return ({"content": new} if new else {}), len(text)
        delta: dict = {"tool_calls": [{"index": k, **c} for k, c in enumerate(whole["tool_calls"])]}
        before = text[sent : tool_parsers.PARSERS[self.tools.parser].sendable(text)]
        return ({"content": before, **delta} if before.strip() else delta), len(text)

    def _logprobs(self, token_ids, entries) -> dict | None:
        if not self.req.logprobs:
            return None
        token_text = TokenIds() if self.req.return_tokens_as_token_ids else self.ctx.token_text
        return chat_logprobs(token_ids, entries or [], self.req.top_logprobs or 0, token_text)

    def _usage(self, completion_tokens: int, out: RequestOutput | None) -> dict:
        return usage([self.sub], completion_tokens, [out])

    def _envelope(self, kind: str, choices: list[dict]) -> dict:
        return {"id": self.rid, "object": kind, "created": self.created, "model": self.model,
                "choices": choices}  # fmt: skip

    def response(self, final: RequestOutput) -> dict:
        choices = [
            {
                "index": c.index,
                "message": (message := self._message(c.text)),
                "logprobs": self._logprobs(c.token_ids, c.logprobs),
                "finish_reason": self._finish_reason(c.finish_reason, message),
                "stop_reason": c.stop_reason,
            }
            for c in final.outputs
        ]
        body = self._envelope("chat.completion", choices)
        body["usage"] = self._usage(sum(len(c.token_ids) for c in final.outputs), final)
        if self.req.prompt_logprobs is not None:  # vLLM's field: on the response, the prompt being the choices' one
            body["prompt_logprobs"] = prompt_logprobs(self.sub.prompt_ids, final.prompt_logprobs, final.prompt_ranks,
                                                      self.req.prompt_logprobs, self.ctx.token_text)  # fmt: skip
        return body

    async def stream(self, admission: Admission) -> AsyncIterator[str]:
        options = self.req.stream_options
        include_usage = bool(options and options.include_usage)
        continuous = bool(options and options.continuous)
        n = self.req.n
        sent_chars, sent_tokens = [0] * n, [0] * n
        finished = [False] * n
        self._calls_out = [0] * n  # "required": the calls sent
        last = None

        def chunk(choices: list[dict]) -> str:
            body = self._envelope("chat.completion.chunk", choices)
            if include_usage:
                body["usage"] = self._usage(sum(sent_tokens), last) if continuous else None
            return sse(body)

        # The role comes first, before any token: clients show the turn at once.
        for i in range(n):
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}])  # fmt: skip
        try:
            async for _, out in merge([run_request(self.ctx.state, self.ctx.metrics, self.sub, admission, 0)]):
                last = out
                for c in out.outputs:
                    i = c.index
                    if finished[i]:
                        continue
                    if len(c.text) == sent_chars[i] and c.finish_reason is None:
                        continue  # text held back (an unfinished character or a possible stop string)
                    delta, sent = self._delta(i, c.text, sent_chars[i], c.finish_reason is not None)
                    if delta is None:  # held back (tool calls), the tokens' logprobs with it
                        continue
                    reason = self._finish_reason(c.finish_reason, delta)
                    choice = {
                        "index": i,
                        "delta": delta,
                        "logprobs": self._logprobs(c.token_ids[sent_tokens[i] :], (c.logprobs or [])[sent_tokens[i] :]),
                        "finish_reason": reason,
                        "stop_reason": c.stop_reason,
                    }
                    sent_chars[i], sent_tokens[i] = sent, len(c.token_ids)
                    finished[i] = c.finish_reason is not None
                    yield chunk([choice])
            if include_usage:
                body = self._envelope("chat.completion.chunk", [])
                body["usage"] = self._usage(sum(sent_tokens), last)
                yield sse(body)
        except APIError as e:  # the engine died mid-stream: the status line is sent already, so say it in-band
            yield sse(e.body())
        yield SSE_DONE
