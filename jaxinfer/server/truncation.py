"""The context-window rule: a request's prompt plus the completion tokens it asks for must fit the context.

A request that does not fit is a 400 with code `context_length_exceeded` naming the limit, as OpenAI answers. Two
opt-ins drop the oldest part of the prompt instead:
- completions: `truncate_prompt_tokens` (vLLM's name) keeps the prompt's last N tokens; -1 keeps as many as fit;
- chat: `--chat-truncation oldest` drops the oldest turns, always keeping the system prompt(s) and everything from
  the last user message on.
What was dropped is reported in the response's usage (`truncated_messages`, `truncated_prompt_tokens`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from jaxinfer.server.errors import APIError, bad_request
from jaxinfer.tokenizer import Tokenizer

_SYSTEM_ROLES = ("system", "developer")

T = TypeVar("T")


@dataclass(frozen=True)
class Truncation:
    """What one prompt lost to the context window."""

    prompt_tokens: int = 0
    messages: int | None = None  # chat only

    def usage(self) -> dict[str, int]:
        """The usage extension fields."""
        fields = {"truncated_prompt_tokens": self.prompt_tokens}
        if self.messages is not None:
            fields["truncated_messages"] = self.messages
        return fields


def usage_fields(truncations: Sequence[Truncation | None]) -> dict[str, int]:
    """The usage extension of a response whose prompts were truncated as given (None: the rule was not asked for)."""
    given = [t for t in truncations if t is not None]
    if not given:
        return {}
    fields: dict[str, int] = {}
    for t in given:
        for key, value in t.usage().items():
            fields[key] = fields.get(key, 0) + value
    return fields


def context_error(limit: int, prompt_len: int, completion: int, param: str, hint: str) -> APIError:
    return APIError(
        400,
        f"This model's maximum context length is {limit} tokens; the request needs {prompt_len + completion} "
        f"({prompt_len} in the prompt, {completion} for the completion){hint}",
        param,
        "context_length_exceeded",
    )


def completion_room(max_tokens: int | None, limit: int, param: str) -> int:
    """The completion tokens a request needs room for: what it asked (None: at least one). A request that asks for
    the whole context or more can never fit, whatever its prompt: a 400 naming the completion's parameter."""
    need = 1 if max_tokens is None else max(1, max_tokens)
    if need >= limit:
        raise APIError(400, f"{param}: {need} completion tokens leave no room for a prompt in this model's maximum "
                       f"context length of {limit} tokens", param, "context_length_exceeded")  # fmt: skip
    return need


# How many characters a token of text has at most, for a first look at a long prompt (normal text: 3-5).
_PROBE_CHARS_PER_TOKEN = 16


def refuse_surely_too_long(tokenizer: Tokenizer, text: str, limit: int, param: str) -> None:
    """A 400 for a text that cannot fit the context whatever its tokens, found without encoding it all: megabytes of
    prompt took seconds of CPU on the pool every request's tokenization shares, for a refusal. Only what is sure is
    refused, so a text that fits always reaches the exact rule (`check_fits`):
    - a token stands for at most `max_token_bytes` of text, so a text over twice that many characters a token of the
      context is too long (twice: a normalizer may join characters, as NFKC joins an accent to its letter);
    - its first `_PROBE_CHARS_PER_TOKEN` characters a token of the context: the rest of a text cannot take away
      more than the tokens where the look stopped, so more than twice the context there is too long."""
    probe = text[: _PROBE_CHARS_PER_TOKEN * (limit + 64)]
    if len(probe) == len(text):  # short enough to encode whole (nor is the vocabulary scanned for its longest token)
        return
    if len(text) > 2 * tokenizer.max_token_bytes * limit:
        raise APIError(400, f"This model's maximum context length is {limit} tokens; the {param} of {len(text)} "
                       f"characters needs more, whatever its tokens", param, "context_length_exceeded")  # fmt: skip
    seen = len(tokenizer.encode(probe, add_special_tokens=False))
    if seen > 2 * limit + 64:
        message = f"This model's maximum context length is {limit} tokens; the first {len(probe)} characters of "
        raise APIError(400, f"{message}the {param} alone hold {seen}", param, "context_length_exceeded")


def check_fits(prompt_len: int, need: int, limit: int, param: str) -> None:
    if prompt_len + need > limit:
        raise context_error(limit, prompt_len, need, param, "; shorten the prompt or the completion")


def keep_last_tokens(
    ids: list[int], keep: int | None, need: int, limit: int, param: str
) -> tuple[list[int], Truncation | None]:
    """Completions' `truncate_prompt_tokens` (vLLM's semantics: the last `keep` tokens; -1: as many as fit)."""
    if keep is None:
        check_fits(len(ids), need, limit, param)
        return ids, None
    if keep == -1:
        keep = limit - need
    elif keep < 1:
        raise bad_request(f"truncate_prompt_tokens must be -1 or >= 1, got {keep}", "truncate_prompt_tokens")
    kept = ids[-keep:] if len(ids) > keep else ids
    check_fits(len(kept), need, limit, param)
    return kept, Truncation(len(ids) - len(kept))


def _turn_cuts(roles: Sequence[str]) -> list[int]:
    """Where the kept conversation may start: dropping up to cut k drops every non-system message before it. Each
    cut is a user message (so a turn goes with its replies and the rest still alternates); the last one is the
    last user message (the last message when there is no user message), which is always kept."""
    last = max((i for i, r in enumerate(roles) if r == "user"), default=len(roles) - 1)
    first = next((i for i, r in enumerate(roles) if r not in _SYSTEM_ROLES), last)
    return [i for i in range(first + 1, last) if roles[i] == "user"] + ([last] if last > first else [])


def drop_oldest_turns(
    messages: list[dict], encode: Callable[[list[dict]], T], length: Callable[[T], int], need: int, limit: int
) -> tuple[T, Truncation]:
    """`--chat-truncation oldest`: the encoded conversation without as few of its oldest turns as make it fit.

    Prompt length only shrinks as turns go, so the fewest turns to drop are found by bisection: a few renders of
    the chat template, however long the conversation."""
    full = encode(messages)
    full_len = length(full)
    if full_len + need <= limit:
        return full, Truncation(0, 0)
    roles = [m["role"] for m in messages]
    cuts = _turn_cuts(roles)

    def without(k: int) -> list[dict]:
        cut = cuts[k - 1]
        return [m for i, m in enumerate(messages) if i >= cut or roles[i] in _SYSTEM_ROLES]

    best: tuple[T, int] | None = None
    lo, hi = 1, len(cuts)  # the fewest turns to drop lies in [lo, hi], if any number fits
    while lo <= hi:
        mid = (lo + hi) // 2
        encoded = encode(without(mid))
        if length(encoded) + need <= limit:
            best, hi = (encoded, mid), mid - 1
        else:
            lo = mid + 1
    if best is None:
        kept_len = length(encode(without(len(cuts)))) if cuts else full_len
        raise context_error(limit, kept_len, need, "messages",
                            " even with only the system prompt and the last user message")  # fmt: skip
    encoded, k = best
    return encoded, Truncation(full_len - length(encoded), len(messages) - len(without(k)))
