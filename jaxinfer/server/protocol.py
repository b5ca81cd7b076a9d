"""Request bodies of the OpenAI-compatible API (OpenAI's names, plus vLLM's sampling extras).

Every model forbids unknown fields: a parameter we do not know is an error, never silently ignored. Parameters
OpenAI defines but this server does not implement are declared (typed `Any`) so that the error can say so:
`unsupported_fields` lists the ones a request (or a chat message) set to anything but their "not used" value in
`_NOT_USED`. A null is "not set", as in OpenAI's API (`_Strict._null_means_default`).
"""

from __future__ import annotations

import functools
from typing import Annotated, Any, Literal, TypeVar, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator

T = TypeVar("T")
# A request's lists stop at their first bad item: 1.3M invalid messages in a 3.7 MiB body made pydantic collect
# 2.6M errors (3 GB, 9 s holding the GIL) for a 400 that names one.
Many = Annotated[list[T], Field(fail_fast=True)]


@functools.cache
def _defaulted_on_null(model: type[BaseModel]) -> frozenset[str]:
    """The fields of `model` that have a default and whose type does not take None."""
    return frozenset(
        name
        for name, field in model.model_fields.items()
        if not field.is_required() and field.annotation is not Any and type(None) not in get_args(field.annotation)
    )


# The OpenAI fields this server knows but does not implement, with the value that means "not used".
_NOT_USED: dict[str, tuple[Any, ...]] = {
    "suffix": (None, ""),
    # OpenAI's deprecated forms of tools and tool_choice
    "functions": (None, []),
    "function_call": (None, "none"),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "service_tier": (None, "auto", "default"),
    "store": (None, False),
    "web_search_options": (None,),
    # vLLM's: beam search (offline only here: LLM.beam_search), and priority scheduling (vLLM's default 0 is fine)
    "use_beam_search": (None, False),
    "length_penalty": (None, 1, 1.0),
    "priority": (None, 0),
    # a chat message's (history written by a server that has them)
    "refusal": (None,),
}


class _Strict(BaseModel):
    # strict: "1" is not a number and 1 is not a bool, as in OpenAI's own API.
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """OpenAI's API reads null as "not set" for its optional fields, and clients that write every field send
        it (`"n": null`, `"stream": null`). A field whose type has no None of its own takes its default then; one
        that has one keeps it, since there null may mean something else than absent (completions' `max_tokens`:
        null is the rest of the context, absent is 16). A required field stays required."""
        if not isinstance(data, dict):
            return data
        drop = _defaulted_on_null(cls)
        return {k: v for k, v in data.items() if not (v is None and k in drop)}

    def unsupported_fields(self) -> list[str]:
        """The fields of `_NOT_USED` this request set to a value that would need them implemented."""
        data = self.model_dump(exclude_unset=True)
        return [k for k in _NOT_USED if k in data and data[k] not in _NOT_USED[k]]


class StreamOptions(_Strict):
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk carries the usage so far (not only the last, choice-less one).
    continuous_usage_stats: bool = False
    # OpenAI's: whether chunks carry an `obfuscation` padding field. This server never adds one, so either is true.
    include_obfuscation: bool = True

    @property
    def continuous(self) -> bool:
        return self.include_usage and self.continuous_usage_stats


class JsonSchemaFormat(_Strict):
    """OpenAI's response_format.json_schema."""

    name: Annotated[str, Field(max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")]
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")  # required here: without one there is nothing to follow
    strict: bool | None = None  # the schema is followed either way


class ResponseFormat(_Strict):
    """OpenAI's response_format: plain text, any JSON object, or JSON that follows a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(_Strict):
    """vLLM's `structured_outputs` extra: exactly one of these constraints (jaxinfer.types.StructuredOutputsParams)."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: Many[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False


class SamplingRequest(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | Many[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # names the session whose KV is kept between turns (without X-Session-Id); same output
    # OpenAI's tags for a stored completion. This server stores none (`store` must stay false), so they change
    # nothing, on OpenAI's side as here; they are checked to OpenAI's limits and accepted, not refused.
    metadata: Annotated[dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
                        Field(max_length=16)] | None = None  # fmt: skip
    # vLLM's extras.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: Many[int] | None = None
    allowed_token_ids: Many[int] | None = None
    bad_words: Many[str] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # The top alternatives of every prompt token, and its own logprob and rank (not with stream, as vLLM).
    prompt_logprobs: int | None = None
    return_tokens_as_token_ids: bool = False  # logprobs' tokens as "token_id:N" (vLLM's)
    # Constrained output: OpenAI's response_format, vLLM's structured_outputs, and vLLM's older guided_* fields,
    # which clients still send (one of them per request).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Many[str] | None = None
    guided_grammar: str | None = None
    # Known but not implemented: see _NOT_USED.
    use_beam_search: Any = None
    length_penalty: Any = None
    priority: Any = None
    service_tier: Any = None
    store: Any = None


class CompletionRequest(SamplingRequest):
    prompt: str | Many[str] | Many[int] | Many[Many[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    add_special_tokens: bool = True  # vLLM's extra: BOS & co. where the tokenizer adds them
    truncate_prompt_tokens: int | None = None  # vLLM's extra: keep the prompt's last N tokens (-1: as many as fit)
    suffix: Any = None


class ContentPart(_Strict):
    """A part of a message's content. Only text is implemented; the other OpenAI kinds are declared so that the
    error can say they are not supported (see ChatMessage.text)."""

    type: str
    text: str | None = None
    image_url: Any = None
    input_audio: Any = None
    file: Any = None
    refusal: Any = None  # an assistant turn's refusal, as OpenAI's history holds it


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI writes it


class ToolCall(_Strict):
    """A tool call in an assistant message of the history (as this server or OpenAI's wrote it)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    # "function" (the deprecated form of a tool's result) is known so that the error can name it (chat_messages).
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | Many[ContentPart] | None = None  # None: an assistant message that only calls tools
    tool_call_id: str | None = None  # a tool message's: the call it answers
    name: str | None = None  # passed to the chat template, which decides (ChatML's ignores it, as in vLLM)
    tool_calls: Many[ToolCall] | None = None
    # Known but not implemented: see _NOT_USED.
    refusal: Any = None
    function_call: Any = None
    audio: Any = None

    def text(self) -> str:
        """The content as one string; ValueError naming the part that is not text."""
        if self.content is None:
            if self.role == "assistant" and self.tool_calls:
                return ""
            raise ValueError("needs a content (only an assistant message with tool_calls may leave it out)")
        if isinstance(self.content, str):
            return self.content
        texts = []
        for part in self.content:
            if part.type != "text":
                raise ValueError(f"content parts of type {part.type!r} are not supported (only 'text')")
            if part.text is None:
                raise ValueError("a content part of type 'text' needs its 'text'")
            texts.append(part.text)
        return "\n".join(texts)


class FunctionDefinition(_Strict):
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments; None: any object
    strict: bool | None = None  # the arguments follow the schema either way (the grammar enforces it)


class ChatTool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    messages: Many[ChatMessage]
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens; both work
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: Many[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None
    # vLLM's extras: the chat template's flags and variables (e.g. enable_thinking); continue_final_message goes on
    # with the last (assistant) message instead of answering it.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(_Strict):
    """vLLM's /tokenize: either a prompt or chat messages."""

    model: str | None = None
    prompt: str | None = None
    messages: Many[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (the template has BOS)
    tools: Many[ChatTool] | None = None  # the template's `tools`, as a chat request's
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


def template_kwargs(req: TokenizeRequest | ChatCompletionRequest) -> dict[str, Any]:
    """The chat template's arguments a request gives: its tools (OpenAI's dicts, as transformers' templates read
    them) and flags, then its chat_template_kwargs over them (vLLM's order)."""
    tools = {"tools": [t.model_dump(exclude_none=True) for t in req.tools]} if req.tools else {}
    return {**tools, "add_generation_prompt": req.add_generation_prompt,
            "continue_final_message": req.continue_final_message, **(req.chat_template_kwargs or {})}  # fmt: skip


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: Many[int]
