"""GET /tokenizer_info in vLLM's shape: what a client needs to tokenize as the server does, without downloading
the tokenizer from a hub. lm-evaluation-harness's `local-completions` probes this route (and POST /tokenize) and,
when both answer, uses the server's tokenizer ("remote" backend) instead of loading one from Hugging Face."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from jaxinfer.server.context import ServingContext


def tokenizer_info(ctx: ServingContext) -> dict:
    """vLLM's TokenizerInfoResponse: `tokenizer_class` plus the tokenizer-config fields, the chat template
    included. Fields the model's files do not define are null rather than guessed."""
    tk = ctx.tokenizer
    return {
        "tokenizer_class": "jaxinfer.tokenizer.Tokenizer",
        "bos_token": tk.bos_token,
        "eos_token": tk.eos_token,
        "pad_token": tk.pad_token,
        "unk_token": tk.unk_token,
        "add_bos_token": tk.add_bos_token,
        "chat_template": tk.chat_template,
        "model_max_length": ctx.state.max_model_len,
        "vocab_size": tk.vocab_size,
        "eos_token_ids": list(tk.eos_token_ids),
    }


def router() -> APIRouter:
    r = APIRouter()

    @r.get("/tokenizer_info")
    async def get_tokenizer_info(request: Request) -> JSONResponse:
        ctx: ServingContext = request.app.state.ctx
        ctx.state.require_ready()
        return JSONResponse(tokenizer_info(ctx))

    return r
