"""Per-token logprobs in OpenAI's two shapes: legacy completions and chat."""

from __future__ import annotations

import math

from jaxinfer.tokenizer import Tokenizer

_FLOOR = -9999.0


class TokenText:
    """Token id -> the text OpenAI shows for it (the token decoded on its own, special tokens kept), memoised."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self._tokenizer.decode([token_id], skip_special_tokens=False)
        return text


def _ranked(entry: dict[int, float]) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda kv: -kv[1])


def completion_logprobs(
    token_ids: list[int],
    entries: list[dict[int, float] | None],
    num_top: int,
    token_text: TokenText,
    text_offset: int,
) -> dict:
    """{tokens, token_logprobs, top_logprobs, text_offset}; offsets count from `text_offset` (the echoed prompt).

    top_logprobs holds the `num_top` most likely tokens plus the sampled one when it is not among them, as OpenAI
    documents ("up to logprobs+1 elements"). A None entry (the first prompt token of an echo: nothing scores it)
    gives None for its token_logprobs and top_logprobs, as in OpenAI's and vLLM's answers.
    """
    tokens, token_lps, tops, offsets = [], [], [], []
    offset = text_offset
    for tok, entry in zip(token_ids, entries, strict=True):
        text = token_text(tok)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if entry is None:
            token_lps.append(None)
            tops.append(None)
            continue
        token_lps.append(_finite(entry.get(tok)))
        top: dict[str, float] = {}
        for tid, lp in _ranked(entry)[:num_top]:
            top.setdefault(token_text(tid), _finite(lp))
        top.setdefault(text, _finite(entry.get(tok)))  # the sampled token is always there, even with logprobs=0
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def join_logprobs(first: dict, second: dict) -> dict:
    """Two legacy logprobs objects one after the other (the echoed prompt's, then the completion's)."""
    return {key: first[key] + second[key] for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def _finite(logprob: float | None) -> float:
    # JSON has no -Infinity: a token masked out (top-k, logit bias) shows OpenAI's floor value instead.
    return logprob if logprob is not None and math.isfinite(logprob) else _FLOOR


def _chat_token(token_text: str, logprob: float | None) -> dict:
    return {
        "token": token_text,
        "logprob": _finite(logprob),
        "bytes": list(token_text.encode("utf-8", errors="replace")),
    }


def chat_logprobs(token_ids: list[int], entries: list[dict[int, float]], num_top: int, token_text: TokenText) -> dict:
    """{"content": [{token, logprob, bytes, top_logprobs: [the num_top most likely, best first]}]}."""
    content = []
    for tok, entry in zip(token_ids, entries, strict=True):
        item = _chat_token(token_text(tok), entry.get(tok))
        item["top_logprobs"] = [_chat_token(token_text(t), lp) for t, lp in _ranked(entry)[:num_top]]
        content.append(item)
    return {"content": content}
