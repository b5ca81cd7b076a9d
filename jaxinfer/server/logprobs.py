"""Per-token logprobs in OpenAI's two shapes: legacy completions and chat."""

from __future__ import annotations

import math
from collections.abc import Sequence

from jaxinfer.detokenizer import IncrementalDetokenizer
from jaxinfer.tokenizer import Tokenizer

_FLOOR = -9999.0


class TokenText:
    """Token id -> the text OpenAI shows for it (the token decoded on its own, special tokens kept), memoised;
    and its raw bytes (chat logprobs' `bytes`)."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self._tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def token_bytes(self, token_id: int) -> list[int]:
        """The token's own UTF-8 bytes, where its text is lossy: a token holding part of a character (a byte-level
        piece of an emoji) decodes alone to U+FFFD, but the bytes of consecutive tokens join into the text."""
        return list(self._tokenizer.token_bytes(token_id))


class TokenIds:
    """vLLM's return_tokens_as_token_ids: a token shown as "token_id:N" (a client then knows the ids of the tokens
    that are not whole characters, whose texts are lossy), in TokenText's place; its `bytes` are that text's."""

    def __call__(self, token_id: int) -> str:
        return f"token_id:{token_id}"

    def token_bytes(self, token_id: int) -> list[int]:
        return list(self(token_id).encode())


class TextOffsets:
    """Where each generated token's text starts in the text of its output: legacy completions' text_offset.

    The tokens go through an `IncrementalDetokenizer` again, as the engine's output path put them through one
    (the same prompt context and skip_special_tokens), and a token starts after the characters that were final
    before it. So offsets count the characters of the output's text, not the lengths of the tokens' strings
    (U+FFFD for each piece of a split character, "<|im_end|>" for a skipped special token); and they are the same
    for a streamed and a whole response, whatever text was held back meanwhile. The tokens that hold the pieces
    of one character share the offset where it starts; a token that adds no text starts where the next text
    does. The output's text may end before a token's start (cut before a stop string, or the stop token's own
    text left out): `clamped` places such a token at the end of the text.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool):
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens)
        self._chars = 0
        self.starts: list[int] = []  # one per token seen, non-decreasing

    def extend(self, token_ids: Sequence[int]) -> None:
        """Takes the output's tokens so far (a longer list each call): places those not seen yet."""
        for tok in token_ids[len(self.starts) :]:
            self.starts.append(self._chars)
            self._chars += len(self._detok.add(tok))

    def clamped(self, start: int, stop: int, text_len: int, base: int) -> list[int]:
        """Offsets of tokens [start, stop) in a text of `text_len` characters that follows `base` characters."""
        return [base + min(at, text_len) for at in self.starts[start:stop]]


def _ranked(entry: dict[int, float]) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda kv: -kv[1])


def completion_logprobs(
    token_ids: list[int],
    entries: list[dict[int, float] | None],
    num_top: int,
    token_text: TokenText | TokenIds,
    text_offsets: list[int],
) -> dict:
    """{tokens, token_logprobs, top_logprobs, text_offset}, the offsets as given (`TextOffsets`).

    top_logprobs holds the `num_top` most likely tokens plus the sampled one when it is not among them, as OpenAI
    documents ("up to logprobs+1 elements"). A None entry (the first prompt token of an echo: nothing scores it)
    gives None for its token_logprobs and top_logprobs, as in OpenAI's and vLLM's answers.
    """
    tokens, token_lps, tops = [], [], []
    for tok, entry in zip(token_ids, entries, strict=True):
        text = token_text(tok)
        tokens.append(text)
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
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": list(text_offsets)}


def join_logprobs(first: dict, second: dict) -> dict:
    """Two legacy logprobs objects one after the other (the echoed prompt's, then the completion's)."""
    return {key: first[key] + second[key] for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def _finite(logprob: float | None) -> float:
    # JSON has no -Infinity: a token masked out (top-k, logit bias) shows OpenAI's floor value instead.
    return logprob if logprob is not None and math.isfinite(logprob) else _FLOOR


def _chat_token(token_id: int, logprob: float | None, token_text: TokenText | TokenIds) -> dict:
    # `token` is the token decoded alone (lossy for part of a character), `bytes` its real bytes: OpenAI's field is
    # there so that a client can join the bytes of the tokens that share a character and decode them.
    return {"token": token_text(token_id), "logprob": _finite(logprob), "bytes": token_text.token_bytes(token_id)}


def chat_logprobs(
    token_ids: list[int], entries: list[dict[int, float]], num_top: int, token_text: TokenText | TokenIds
) -> dict:
    """{"content": [{token, logprob, bytes, top_logprobs: [the num_top most likely, best first]}]}."""
    content = []
    for tok, entry in zip(token_ids, entries, strict=True):
        item = _chat_token(tok, entry.get(tok), token_text)
        item["top_logprobs"] = [_chat_token(t, lp, token_text) for t, lp in _ranked(entry)[:num_top]]
        content.append(item)
    return {"content": content}


def prompt_logprobs(
    prompt_ids: list[int],
    entries: list[dict[int, float] | None] | None,
    ranks: list[int | None] | None,
    num_top: int,
    token_text: TokenText,
) -> list[dict[str, dict] | None]:
    """vLLM's `prompt_logprobs`: for each prompt token, None for the first (nothing scores it), else {token id:
    {logprob, rank, decoded_token}} for the token itself and the `num_top` most likely ones (so num_top or
    num_top + 1 entries). The token's rank is its place in the whole vocabulary (the engine counts it); the others'
    their place among the most likely."""
    entries, ranks = list(entries or []), list(ranks or [])
    out: list[dict[str, dict] | None] = []
    for p, tok in enumerate(prompt_ids):
        entry = entries[p] if p < len(entries) else None
        if entry is None:
            out.append(None)
            continue
        rank = ranks[p] if p < len(ranks) else None
        item = {str(tok): {"logprob": _finite(entry.get(tok)), "rank": rank, "decoded_token": token_text(tok)}}
        for place, (tid, lp) in enumerate(_ranked(entry)[:num_top], start=1):
            item.setdefault(str(tid), {"logprob": _finite(lp), "rank": place, "decoded_token": token_text(tid)})
        out.append(item)
    return out
