"""OpenAI request fields -> `SamplingParams`, with vLLM's OpenAI-server defaults.

SamplingParams validates every value and names the field in its ValueError; that becomes a 400 with `param` set.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from jaxinfer.server.args import ServerArgs
from jaxinfer.server.errors import bad_request, from_value_error
from jaxinfer.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest
from jaxinfer.server.structured import structured_outputs
from jaxinfer.types import SamplingParams, StructuredOutputsParams


def reject_unsupported(req: SamplingRequest) -> None:
    for name in req.unsupported_fields():
        raise bad_request(f"{name} is not supported by this server", name, "unsupported_parameter")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    if req.prompt_logprobs is not None and req.stream:  # as vLLM: they come whole, in the response body
        raise bad_request("prompt_logprobs is not available when stream is true", "prompt_logprobs")


def check_fanout(req: SamplingRequest, args: ServerArgs, renames: dict[str, str] | None = None) -> None:
    """The per-request bounds of the server's flags (--max-n, --max-stop, ...): 400s naming the parameter."""
    if req.n > args.max_n:
        raise bad_request(f"n must be at most {args.max_n} (--max-n), got {req.n}", "n")
    stop = [req.stop] if isinstance(req.stop, str) else req.stop or []
    if len(stop) > args.max_stop:
        raise bad_request(f"stop: at most {args.max_stop} stop strings (--max-stop), got {len(stop)}", "stop")
    longest = max(map(len, stop), default=0)
    if longest > args.max_stop_len:
        raise bad_request(f"stop: each stop string has at most {args.max_stop_len} characters (--max-stop-len), got "
                          f"{longest}", "stop")  # fmt: skip
    ids = req.stop_token_ids or []
    if len(ids) > args.max_stop_token_ids:
        raise bad_request(f"stop_token_ids: at most {args.max_stop_token_ids} (--max-stop-token-ids), got {len(ids)}",
                          "stop_token_ids")  # fmt: skip


def _or(value, default):
    return default if value is None else value


# SamplingParams' own defaults of the fields a model's generation_config.json may set instead.
_BUILT_IN = {
    f.name: f.default
    for f in dataclasses.fields(SamplingParams)
    if f.name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
}


def build_params(
    req: SamplingRequest,
    max_tokens: int,
    logprobs: int | None,
    renames: dict[str, str] | None = None,
    prompt_logprobs: int | None = None,
    defaults: Mapping[str, float | int] | None = None,
    tools: StructuredOutputsParams | None = None,
) -> SamplingParams:
    """`defaults`: the model's values for the sampling fields a request leaves unset (its generation_config.json).
    `tools`: the constraint of a chat request's tool_choice (jaxinfer.server.tools)."""
    d = {**_BUILT_IN, **(defaults or {})}
    structured = structured_outputs(req, tools)  # a 400 of its own, naming the client's field
    try:
        return SamplingParams(
            n=req.n,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            temperature=_or(req.temperature, d["temperature"]),
            top_p=_or(req.top_p, d["top_p"]),
            top_k=_or(req.top_k, d["top_k"]),
            min_p=_or(req.min_p, d["min_p"]),
            repetition_penalty=_or(req.repetition_penalty, d["repetition_penalty"]),
            presence_penalty=_or(req.presence_penalty, 0.0),
            frequency_penalty=_or(req.frequency_penalty, 0.0),
            logit_bias=req.logit_bias,
            seed=req.seed,
            stop=_or(req.stop, ()),
            stop_token_ids=tuple(req.stop_token_ids or ()),
            allowed_token_ids=None if req.allowed_token_ids is None else tuple(req.allowed_token_ids),
            bad_words=None if req.bad_words is None else tuple(req.bad_words),
            ignore_eos=req.ignore_eos,
            include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            structured_outputs=structured,
        )
    except ValueError as e:
        raise from_value_error(e, renames) from None


def _capped(max_tokens: int, defaults: Mapping[str, float | int] | None) -> int:
    """A request that sets no max_tokens: its default, capped by the model's generation_config.json max_new_tokens
    (as vLLM). One that sets it gets what it asked for."""
    cap = (defaults or {}).get("max_tokens")
    return max_tokens if cap is None else min(max_tokens, int(cap))


def completion_params(
    req: CompletionRequest, prompt_len: int, context: int, defaults: Mapping[str, float | int] | None = None
) -> SamplingParams:
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of other than n is not supported by this server", "best_of", "unsupported_parameter")
    # vLLM: an explicit null means "as many as fit".
    max_tokens = req.max_tokens if req.max_tokens is not None else max(1, context - prompt_len)
    if "max_tokens" not in req.model_fields_set or req.max_tokens is None:
        max_tokens = _capped(max_tokens, defaults)
    if prompt_only(req):  # the engine runs one step (scoring the prompt); its token is dropped
        max_tokens = 1
    # echo with logprobs also scores the echoed prompt tokens (OpenAI, vLLM): the engine's prompt logprobs, as many
    # top alternatives as either asks for.
    asked = [k for k in (req.logprobs if req.echo else None, req.prompt_logprobs) if k is not None]
    prompt_logprobs = max(asked) if asked else None
    return build_params(req, max_tokens, req.logprobs, prompt_logprobs=prompt_logprobs, defaults=defaults)


def prompt_only(req: CompletionRequest) -> bool:
    """echo with max_tokens 0: scoring clients ask for the prompt (and its logprobs) alone, as vLLM answers."""
    return req.echo and req.max_tokens == 0


def chat_params(
    req: ChatCompletionRequest,
    prompt_len: int,
    context: int,
    defaults: Mapping[str, float | int] | None = None,
    tools: StructuredOutputsParams | None = None,
) -> tuple[SamplingParams, dict[str, str]]:
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
    max_tokens = _or(req.max_completion_tokens, req.max_tokens)
    renames = {"logprobs": "top_logprobs"}
    if req.max_completion_tokens is not None:
        renames["max_tokens"] = "max_completion_tokens"
    if max_tokens is None:  # vLLM's chat default: the rest of the context
        max_tokens = _capped(max(1, context - prompt_len), defaults)
    logprobs = _or(req.top_logprobs, 0) if req.logprobs else None
    params = build_params(req, max_tokens, logprobs, renames, req.prompt_logprobs, defaults, tools)
    return params, renames
