"""POST /tokenize and /detokenize, in vLLM's shapes."""

from __future__ import annotations

import functools

from starlette.requests import Request
from starlette.responses import JSONResponse

from jaxinfer.server.body import parse_request
from jaxinfer.server.chat import render_chat
from jaxinfer.server.context import ServingContext
from jaxinfer.server.errors import bad_request
from jaxinfer.server.protocol import DetokenizeRequest, TokenizeRequest, template_kwargs


async def tokenize(ctx: ServingContext, request: Request) -> JSONResponse:
    req = await parse_request(request, TokenizeRequest, ctx.args.max_body_bytes, ctx.off_loop, ctx.state.body_reads)
    ctx.state.require_ready()
    ctx.model_name(req.model)
    return await ctx.json_response(lambda: _tokenize(ctx, req))  # templates, tokenization, JSON: off the event loop


def _tokenize(ctx: ServingContext, req: TokenizeRequest) -> dict:
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("give exactly one of prompt and messages", "prompt")
    tk = ctx.tokenizer
    if req.messages is not None:
        text = render_chat(tk, req.messages, template_kwargs(req))
        ids = tk.encode(text, add_special_tokens=bool(req.add_special_tokens))
    else:
        assert req.prompt is not None
        for name in ("add_generation_prompt", "continue_final_message", "chat_template_kwargs", "tools"):
            if name in req.model_fields_set:  # the template's: a prompt has no template to apply
                raise bad_request(f"{name} applies to messages, not to a prompt", name)
        ids = tk.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
    return {
        "count": len(ids),
        "max_model_len": ctx.context_tokens,  # as /v1/models: the limit requests are held to
        "tokens": ids,
        "token_strs": [tk.id_to_token(i) for i in ids] if req.return_token_strs else None,
    }


async def detokenize(ctx: ServingContext, request: Request) -> JSONResponse:
    req = await parse_request(request, DetokenizeRequest, ctx.args.max_body_bytes, ctx.off_loop, ctx.state.body_reads)
    ctx.state.require_ready()
    ctx.model_name(req.model)
    vocab = ctx.tokenizer.vocab_size
    if any(not 0 <= t < vocab for t in req.tokens):
        raise bad_request(f"tokens: token ids must be in [0, {vocab})", "tokens")
    # Special tokens kept, as vLLM's: /tokenize then /detokenize gives the text back (a chat template's markers too).
    text = await ctx.off_loop(functools.partial(ctx.tokenizer.decode, skip_special_tokens=False), req.tokens)
    return JSONResponse({"prompt": text})
