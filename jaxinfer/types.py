"""Host-only vocabulary shared by the scheduler, engine, offline API and server (no jax import)."""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import math
import numbers
import time
from dataclasses import dataclass, field
from typing import Any, Protocol


def is_integer(x: object) -> bool:
    """An integer a caller may hand over (numpy's included), and not a bool: int() would take True as 1, and 1.7 as
    1."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _python_number(x: object) -> object:
    """A numpy scalar (np.int64 from `rng.integers`, np.float32 from an array) as the Python number it holds;
    anything else as it is, for the checks to judge. SamplingParams keeps Python types only: its fields cross to
    the engine's process as msgpack."""
    if isinstance(x, bool) or type(x) in (int, float):
        return x
    if is_integer(x):
        return int(x)
    if isinstance(x, numbers.Real):
        return float(x)
    return x


_NUMBERS = ("n", "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
            "presence_penalty", "frequency_penalty", "seed", "logprobs", "prompt_logprobs")  # fmt: skip


def _check(cond: bool, name: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"{name} {msg}")


_log = logging.getLogger(__name__)

MIN_TEMPERATURE = 0.01  # the smallest temperature but 0 (greedy), as vLLM's _MAX_TEMP

# The engine's sampling arrays and the wire to the engine process hold ids and counts as int32.
INT32_MAX = 2**31 - 1
MAX_SESSION_ID_LEN = 256


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrained decoding, vLLM's `StructuredOutputsParams`: exactly one of `json` (a JSON schema, as a dict or its
    text), `regex`, `choice` (the output is one of these strings), `grammar` (Lark or GBNF, as llama.cpp writes
    it) or `json_object` (any JSON object). The output can only be what it describes, then EOS; max_tokens may
    still cut it short. `disable_any_whitespace`: JSON without whitespace between its tokens."""

    json: str | None = None  # a dict is kept as its JSON text: what crosses to the engine's process
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        name = "structured_outputs"
        if isinstance(self.json, dict):
            object.__setattr__(self, "json", json.dumps(self.json))
        if self.choice is not None:
            ok = isinstance(self.choice, list | tuple) and self.choice and all(isinstance(c, str) for c in self.choice)
            _check(ok, f"{name}.choice", f"must be a non-empty list of strings, got {self.choice!r:.80}")
            object.__setattr__(self, "choice", tuple(self.choice))
        for field_name in ("json", "regex", "grammar"):
            v = getattr(self, field_name)
            _check(v is None or (isinstance(v, str) and v), f"{name}.{field_name}",
                   f"must be a non-empty string, got {v!r:.80}")  # fmt: skip
        for field_name in ("json_object", "disable_any_whitespace"):
            v = getattr(self, field_name)
            _check(v is None or isinstance(v, bool), f"{name}.{field_name}", f"must be true or false, got {v!r}")
        given = self.given
        _check(len(given) == 1, name, "needs exactly one of json, regex, choice, grammar or json_object, got "
               f"{', '.join(given) or 'none'}")  # fmt: skip

    @property
    def given(self) -> list[str]:
        """The constraints set: one, once constructed ("json", "regex", "choice", "grammar" or "json_object")."""
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        return given + ["json_object"] if self.json_object else given


@dataclass(frozen=True)
class SamplingParams:
    """Per-request generation settings under vLLM's names. Every field is honoured; there is no field we ignore.

    Stop conditions: EOS (unless ignore_eos), any of stop_token_ids, any of the stop strings (the text never
    shows the stop string, nor the text of the EOS or stop token that ended it, unless include_stop_str_in_output;
    the token stays in token_ids and logprobs, as in vLLM), max_tokens, the context length.
    """

    n: int = 1
    max_tokens: int | None = 16  # None: up to the context length (vLLM's meaning)
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: tuple[int, ...] | None = None  # only these may be sampled (vLLM's); None: any token
    # vLLM's: words the output may not complete (their last token is banned where the output ends with the rest),
    # each with and without a leading space. LLM and the server tokenize them into bad_words_token_ids, which the
    # engine reads (and which may be given instead).
    bad_words: tuple[str, ...] | None = None
    bad_words_token_ids: tuple[tuple[int, ...], ...] | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    detokenize: bool = True  # False: token ids only, every text "" (vLLM's; no stop strings then)
    logprobs: int | None = None  # number of top alternatives per generated token (0: only the sampled token)
    prompt_logprobs: int | None = None  # same, for every prompt token
    # A conversation's id: when the request ends (stop or length, n == 1) the engine pins its KV pages for the
    # session's TTL, so the next turn with the same id prefills only what is new (jaxinfer.cache.sessions).
    # It never changes the output.
    session_id: str | None = None
    # Constrained decoding (JSON schema, regex, choice, grammar): see StructuredOutputsParams.
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        for name in _NUMBERS:
            object.__setattr__(self, name, _python_number(getattr(self, name)))
        for name in ("stop_token_ids", "allowed_token_ids"):
            ids = getattr(self, name)
            if hasattr(ids, "tolist") and not isinstance(ids, list | tuple):
                object.__setattr__(self, name, ids.tolist())  # a numpy array of ids

        def is_int(x: object) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        def num(name: str) -> float:
            v = getattr(self, name)
            _check(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v), name,
                   f"must be a finite number, got {v!r}")  # fmt: skip
            return float(v)

        def count(name: str, lo: int) -> None:
            v = getattr(self, name)
            _check(is_int(v) and lo <= v <= INT32_MAX, name, f"must be an integer in [{lo}, {INT32_MAX}], got {v!r}")

        def token_ids(name: str, values) -> tuple[int, ...]:  # the upper bound is the vocabulary (Engine.validate)
            ids = tuple(_python_number(t) for t in values)
            _check(
                all(is_int(t) and 0 <= t <= INT32_MAX for t in ids), name, "must be token ids (non-negative integers)"
            )
            return ids

        count("n", 1)
        if self.max_tokens is not None:
            count("max_tokens", 1)
        count("min_tokens", 0)
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
               f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens!r}")  # fmt: skip
        _check(num("temperature") >= 0, "temperature", f"must be >= 0, got {self.temperature}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            # As vLLM: only 0 is greedy, and a smaller temperature is raised to 0.01 (it scales the logits into
            # overflow, and would be greedy on the device below 1e-5 without saying so).
            _log.warning("temperature %s is below %s: raised to %s", self.temperature, MIN_TEMPERATURE, MIN_TEMPERATURE)
            object.__setattr__(self, "temperature", MIN_TEMPERATURE)
        _check(0 < num("top_p") <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(
            is_int(self.top_k) and self.top_k >= -1, "top_k", f"must be -1, 0 or a positive integer, got {self.top_k!r}"
        )
        # A top_k at or past the vocabulary keeps every token: past int32 it means the same, and fits the arrays.
        object.__setattr__(self, "top_k", min(self.top_k, INT32_MAX))
        _check(0 <= num("min_p") <= 1, "min_p", f"must be in [0, 1], got {self.min_p}")
        _check(num("repetition_penalty") > 0, "repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        _check(
            -2 <= num("presence_penalty") <= 2, "presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}"
        )
        _check(-2 <= num("frequency_penalty") <= 2, "frequency_penalty",
               f"must be in [-2, 2], got {self.frequency_penalty}")  # fmt: skip
        if self.seed == -1 and is_int(self.seed):  # vLLM's "no seed" (a common UI convention)
            object.__setattr__(self, "seed", None)
        if self.seed is not None:  # OpenAI's and vLLM's range: a signed 64-bit integer (and unsigned ones)
            _check(is_int(self.seed) and -(2**63) <= self.seed < 2**64, "seed",
                   f"must be an integer in [-2**63, 2**64), got {self.seed!r}")  # fmt: skip
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "detokenize"):
            _check(isinstance(getattr(self, name), bool), name, f"must be True or False, got {getattr(self, name)!r}")
        _check(self.stop is None or isinstance(self.stop, str | list | tuple), "stop",
               f"must be a non-empty string or a list of them, got {self.stop!r}")  # fmt: skip
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        _check(all(isinstance(s, str) and s for s in stop), "stop", "must be a non-empty string or a list of them")
        object.__setattr__(self, "stop", stop)
        _check(self.detokenize or not stop, "stop", "strings need detokenize=True (the text they are found in)")
        _check(self.stop_token_ids is None or isinstance(self.stop_token_ids, list | tuple), "stop_token_ids",
               f"must be a list of token ids, got {self.stop_token_ids!r}")  # fmt: skip
        object.__setattr__(self, "stop_token_ids", token_ids("stop_token_ids", self.stop_token_ids or ()))
        if self.allowed_token_ids is not None:
            allowed = self.allowed_token_ids
            _check(isinstance(allowed, list | tuple) and len(allowed) > 0, "allowed_token_ids",
                   f"must be a non-empty list of token ids, got {allowed!r}")  # fmt: skip
            object.__setattr__(self, "allowed_token_ids", token_ids("allowed_token_ids", allowed))
        if self.bad_words is not None:
            words = self.bad_words
            _check(isinstance(words, list | tuple) and all(isinstance(w, str) and w.strip() for w in words),
                   "bad_words", f"must be a list of words (non-blank strings), got {words!r:.80}")  # fmt: skip
            object.__setattr__(self, "bad_words", tuple(words))
        if self.bad_words_token_ids is not None:
            seqs = self.bad_words_token_ids
            _check(isinstance(seqs, list | tuple) and all(isinstance(q, list | tuple) and q for q in seqs),
                   "bad_words_token_ids", f"must be a list of token id sequences, got {seqs!r:.80}")  # fmt: skip
            object.__setattr__(self, "bad_words_token_ids", tuple(token_ids("bad_words_token_ids", q) for q in seqs))
        if self.logit_bias is not None:
            _check(isinstance(self.logit_bias, dict), "logit_bias", "must map token ids to biases")
            bias = {}
            for k, v in self.logit_bias.items():
                key, v = str(_python_number(k)), _python_number(v)
                _check(key.isascii() and key.isdigit() and len(key) <= 10 and int(key) <= INT32_MAX, "logit_bias",
                       f"keys must be token ids, got {k!r}")  # fmt: skip
                _check(isinstance(v, int | float) and not isinstance(v, bool) and -100 <= v <= 100, "logit_bias",
                       f"values must be numbers in [-100, 100], got {v!r}")  # fmt: skip
                bias[int(key)] = float(v)
            object.__setattr__(self, "logit_bias", bias)
        if self.session_id is not None:
            _check(isinstance(self.session_id, str) and 0 < len(self.session_id) <= MAX_SESSION_ID_LEN, "session_id",
                   f"must be a string of 1 to {MAX_SESSION_ID_LEN} characters")  # fmt: skip
        so = self.structured_outputs
        if isinstance(so, dict):  # from the wire, or a caller's dict
            unknown = set(so) - {f.name for f in dataclasses.fields(StructuredOutputsParams)}
            _check(not unknown, "structured_outputs", f"has unknown fields {sorted(map(str, unknown))}")
            object.__setattr__(self, "structured_outputs", StructuredOutputsParams(**so))
        else:
            _check(so is None or isinstance(so, StructuredOutputsParams), "structured_outputs",
                   f"must be a StructuredOutputsParams, got {type(so).__name__}")  # fmt: skip
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None:  # the upper bound is the engine's max_logprobs (Engine.validate)
                _check(is_int(v) and 0 <= v <= INT32_MAX, name, f"must be a number of top tokens >= 0 (None: no "
                       f"logprobs), got {v!r}")  # fmt: skip

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class _Encodes(Protocol):  # jaxinfer.tokenizer.Tokenizer, which this host-only module does not import
    def encode(self, text: str, add_special_tokens: bool) -> list[int]: ...


def with_bad_words_ids(params: SamplingParams, tokenizer: _Encodes) -> SamplingParams:
    """`params` with its bad_words tokenized into bad_words_token_ids (unless given), as vLLM does it: each word
    as written (leading spaces dropped), and with one leading space where that is other tokens of the same count
    (" word" at a word boundary)."""
    if params.bad_words is None or params.bad_words_token_ids is not None:
        return params
    seqs: list[tuple[int, ...]] = []
    for word in params.bad_words:
        plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        seqs.append(plain)
        if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain):
            seqs.append(spaced)
    return dataclasses.replace(params, bad_words_token_ids=tuple(seqs))


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One sequence being generated (an n > 1 request is n of these in one group)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # the sequence's own seed, drawn by the engine when params.seed is None
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)  # when params.logprobs is set
    prompt_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    prompt_ranks: list[int | None] = field(default_factory=list)  # beside prompt_logprobs: each token's rank
    pages: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    queue_order: int = 0  # the scheduler's count at add(): lower is older (n > 1 samples share an arrival_time)
    group: str | None = None  # the n > 1 samples of one prompt share a group, and so the prompt's pages
    block_hashes: list[int] = field(default_factory=list)  # hashes of the leading full pages, as registered
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission
    # Of those, the tokens the host KV tier restored (None: no host tier). Reported with the first token
    # (SeqTiming) and shown as jaxinfer:request_host_cache_hit_rate on /metrics.
    num_host_cached_tokens: int | None = None
    # (dispatched, done, prompt tokens) of each step that computed part of the prompt, in seconds since
    # arrival_time: the prefill chunks of the request's trace.
    prefill_chunks: list[list[float]] = field(default_factory=list)
    grammar: Any = None  # its structured output's position (jaxinfer.engine.grammar.Grammar), when it has one

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token(self, i: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]

    def tokens(self, start: int, stop: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if stop <= n:
            return self.prompt_token_ids[start:stop]
        if start >= n:
            return self.output_token_ids[start - n : stop - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - n]


@dataclass
class SeqTiming:
    """How the engine ran one sequence up to its first token, in seconds since the engine received it: offsets,
    so they mean the same in the API process whatever its clock. Sent once, with the first token."""

    queued_s: float  # until its first step was scheduled
    first_token_s: float
    num_cached_tokens: int  # prompt tokens found in the prefix cache
    prefill_chunks: list[list[float]]  # [dispatched_s, done_s, prompt tokens] of each prefill step
    num_host_cached_tokens: int | None = None  # prompt tokens restored from a host KV tier (None: no tier)

    def to_wire(self) -> list:
        return [self.queued_s, self.first_token_s, self.num_cached_tokens, self.prefill_chunks,
                self.num_host_cached_tokens]  # fmt: skip

    @classmethod
    def from_wire(cls, w: list) -> SeqTiming:
        return cls(*w)


@dataclass
class SeqUpdate:
    """What one engine step did to one sequence: its new tokens (and their logprobs), and whether it ended."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]]
    finished: bool
    finish_reason: str | None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None  # with the first token, when asked for
    prompt_ranks: list[int | None] | None = None  # beside prompt_logprobs (RequestOutput.prompt_ranks)
    error: str | None = None  # finish_reason "error": why the engine failed this sequence (the others go on)
    timing: SeqTiming | None = None  # with the sequence's first token


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """One request's timeline in the clock of the process that reads it (time.monotonic), from its first sample's
    SeqTiming: arrival (handed to the engine), first scheduled, first token, finished."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    num_cached_tokens: int = 0
    num_host_cached_tokens: int | None = None  # None: no host KV tier reported any
    prefill_chunks: list[tuple[float, float, int]] = field(default_factory=list)  # (dispatched, done, tokens)
    detokenize_s: float = 0.0  # time spent turning its tokens into text (and checking stop strings)


@dataclass
class RequestOutput:
    """vLLM-shaped result of one request: one CompletionOutput per sample (n)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, float] | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    error: str | None = None  # the engine failed this request (finish_reason "error"); the message says why
    # Beside prompt_logprobs: each prompt token's rank among the vocabulary under the logits that scored it (1: the
    # most likely; tokens tied with it count as ahead), None for the first token. vLLM's Logprob.rank.
    prompt_ranks: list[int | None] | None = None

    @property
    def num_cached_tokens(self) -> int | None:
        """Prompt tokens found in the prefix cache (vLLM's field); None before the first token."""
        return self.metrics.num_cached_tokens if self.metrics is not None else None


class RequestsFailedError(RuntimeError):
    """`LLM.generate` / `LLM.chat`: the engine failed some of the requests (a model that cannot trace at a step's
    shapes, weights deleted under the engine). Raised once every request has ended, so nothing is lost: `outputs`
    holds all of them in order, the failed ones with finish_reason "error" and the reason in `error`."""

    def __init__(self, outputs: list[RequestOutput]):
        failed = [o for o in outputs if o.error is not None]
        super().__init__(f"{len(failed)} of {len(outputs)} requests failed in the engine; the first "
                         f"({failed[0].request_id}): {failed[0].error}")  # fmt: skip
        self.outputs = outputs
