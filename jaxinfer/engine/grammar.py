"""Structured outputs: a request's StructuredOutputsParams as a grammar (llguidance), and each sequence's matcher.

The engine asks a sequence's `Grammar` for the bitmask of the tokens that may come next before each step that
samples it (the sampler sets every other token to -inf: sampling.SamplingTensors.token_mask), and gives it the
token sampled. When the grammar is complete and nothing can extend it, the sequence ends ("stop").

The grammar text depends on the request alone and is checked without a tokenizer (the API side's `validate`
does it too); the tokenizer's llguidance form is built once, on the first constrained request (a fraction of a
second for a 49k vocabulary), or by the engine core while idle after start-up.
"""

from __future__ import annotations

import functools
import json
import threading

import llguidance
import numpy as np

from jaxinfer.types import StructuredOutputsParams

# JSON's whitespace between tokens, as llama.cpp's JSON grammars allow it: a space, or one or two newlines and an
# indent of up to 20. Unbounded whitespace (vLLM's default) lets a model that favours newlines emit them until
# max_tokens, a known failure of JSON modes; disable_any_whitespace allows none.
JSON_WHITESPACE = r"(?:[ ]|\n{1,2}[ \t]{0,20})?"

# Grammar texts kept: validate and the engine (and the API process's validate) each ask for the same one.
_GRAMMAR_CACHE = 256


def mask_words(vocab_size: int) -> int:
    """The int32 words of a token mask over `vocab_size` tokens (sampling.SamplingTensors.token_mask): a bit each."""
    return -(-vocab_size // 32)


@functools.lru_cache(maxsize=_GRAMMAR_CACHE)
def grammar_text(so: StructuredOutputsParams) -> str:
    """The llguidance grammar for `so`. Raises ValueError naming the field when it is not a valid schema, regex
    or grammar."""
    (kind,) = so.given
    field = f"structured_outputs.{kind}"
    try:
        if kind in ("json", "json_object"):
            # vLLM's json_object: any JSON object.
            options = {"whitespace_flexible": False} if so.disable_any_whitespace else {
                "whitespace_pattern": JSON_WHITESPACE}  # fmt: skip
            schema = so.json if kind == "json" else '{"type": "object"}'
            text = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        elif kind == "choice":
            text = llguidance.grammar_from("choice", json.dumps(list(so.choice)))
        else:  # regex; grammar: Lark, or GBNF as llama.cpp writes it
            text = llguidance.grammar_from("regex" if kind == "regex" else "grammar", getattr(so, kind))
    except ValueError as e:
        raise ValueError(f"{field}: {_one_line(str(e))}") from None
    error = llguidance.LLMatcher.validate_grammar(text)
    if error:
        raise ValueError(f"{field}: {_one_line(error)}")
    return text


def _one_line(message: str) -> str:
    """llguidance's errors draw the grammar's line and a caret over several lines: one line for an API error."""
    return " ".join(message.split())


class Grammar:
    """One sequence's position in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher, words: int):
        """words: the mask's width, `mask_words` of the model's vocabulary."""
        self._matcher = matcher
        self._words = words

    def copy(self) -> Grammar:
        """An independent matcher at the same position (the n samples of one request)."""
        return Grammar(self._matcher.deep_copy(), self._words)

    def mask(self) -> np.ndarray:
        """int32[ceil(V / 32)]: bit t % 32 of word t // 32 set where token t may come next."""
        bits = np.frombuffer(self._matcher.compute_bitmask(), np.int32)
        out = np.zeros(self._words, np.int32)  # ids past the tokenizer's vocabulary (a padded embedding): never
        n = min(self._words, bits.size)
        out[:n] = bits[:n]
        return out

    def accept(self, token: int) -> None:
        """Moves past `token`. Raises ValueError when the grammar does not allow it (a mask that other rules of
        the request, min_tokens or bad_words, emptied)."""
        if not self._matcher.consume_token(int(token)):
            why = _one_line(self._matcher.get_error().split("\n", 1)[0]) or "no token could follow"
            raise ValueError(f"structured_outputs: token {token} does not follow the grammar ({why:.200})")

    @property
    def done(self) -> bool:
        """The grammar is complete and nothing can extend it (only EOS may come)."""
        return self._matcher.is_stopped()


class GrammarCompiler:
    """Makes each constrained request's Grammar, for one tokenizer and the model's vocabulary size."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]):
        """tokenizer: a jaxinfer.tokenizer.Tokenizer (its bytes per token and its encoder are what llguidance
        reads); eos_token_ids: what the grammar allows once complete (the engine's EOS ids)."""
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids or tokenizer.eos_token_ids)
        self._lock = threading.Lock()
        self._ll: llguidance.LLTokenizer | None = None

    @property
    def prepared(self) -> bool:
        """Nothing is left for `prepare` to build (a model without EOS has nothing: its requests are refused)."""
        return self._ll is not None or not self._eos

    def prepare(self) -> None:
        """Builds the vocabulary's llguidance form now (the engine core does it while idle after start-up), so the
        first constrained request does not stall every stream for it."""
        if not self.prepared:
            self._ll_tokenizer()

    def _ll_tokenizer(self) -> llguidance.LLTokenizer:
        if not self._eos:
            raise ValueError("structured_outputs: the model has no EOS token to end a complete output with")
        with self._lock:
            if self._ll is None:
                self._ll = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Wrapped(self._tokenizer, self._eos)),
                                                  n_vocab=self._tokenizer.vocab_size, eos_token=self._eos)  # fmt: skip
            return self._ll

    def grammar(self, so: StructuredOutputsParams) -> Grammar:
        """A fresh Grammar for `so` (ValueError naming the field when it is invalid)."""
        matcher = llguidance.LLMatcher(self._ll_tokenizer(), grammar_text(so), log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured_outputs.{so.given[0]}: {_one_line(matcher.get_error())}")
        return Grammar(matcher, mask_words(self.vocab_size))


class _Wrapped:
    """What llguidance.TokenizerWrapper reads of a tokenizer: each token's bytes, the special ids, an encoder."""

    def __init__(self, tokenizer, eos: list[int]):
        self._tokenizer = tokenizer
        self.eos_token_id = eos[0]
        self.bos_token_id = tokenizer.bos_token_id
        self.tokens = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
        self.special_token_ids = sorted(tokenizer.special_token_ids)

    def __call__(self, text: bytes | str) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text, add_special_tokens=False)
