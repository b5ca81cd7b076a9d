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
