"""On-device sampling with per-row (per-request) parameters, vectorised over the rows of one step.

`sample` runs inside the engine's jitted step on the logits of each sequence's last token, f32[S, V]. Every
parameter is a per-row array, so any mix of requests reuses one compiled program; only `advanced`, `num_logprobs`
and `topk_cap` are static. The host picks the variant per step (`needs_advanced`):
    - basic: greedy, temperature, min-p and the seed: what plain requests use. Its program holds no conditional
      on GPU, where XLA reads a conditional's predicate on the host and the host waits there for the whole forward
      before it can launch the rest (2.7 ms of a 0.6B batch-1 step on an H200): there the draw always runs and
      greedy rows select the argmax. CPU and TPU evaluate predicates on the device itself, so they skip the draw
      when every row is greedy (exp over [S, V] costs milliseconds on CPU).
    - advanced: also logit bias, penalties (they need the token history), allowed tokens, bad words, structured
      outputs' token masks, top-k/top-p and logprobs. Each of these runs under a conditional, skipped when no row
      of the step uses it: a sort-free top-k over a large vocabulary is not free on any backend.

Processing order, as vLLM v1 does it (vllm/v1/sample/sampler.py and the GPU model runner's sampler):
    1. logprobs are taken from the raw model logits (vLLM's default logprobs_mode="raw_logprobs");
    2. logit bias is added (min_tokens arrives here as -inf bias on the stop ids; allowed_token_ids as entries of
       0, every other token of such a row then -inf); bad words and a structured output's grammar set the tokens
       they rule out to -inf;
    3. penalties: repetition over prompt + output tokens, then frequency and presence over output tokens only;
    4. greedy rows (temperature < 1e-5) take the argmax of these processed logits;
    5. temperature;
    6. min-p (vLLM runs it before top-k/top-p; it matters: top-p then renormalises over the min-p survivors);
    7. top-k, then top-p on the top-k-truncated, renormalised distribution;
    8. one draw from what is left.
Truncations keep every token tied with the cut-off value (vLLM's top-k does the same; its top-p keeps ties in
sort order, which only differs for exactly equal logits).

The draw is an inverse-CDF draw from one uniform per row, keyed by fold_in(key(seed), counter): a row's token
depends only on its logits, its parameters, its seed and how many tokens it already generated, never on the batch
size, its row index or its neighbours. It is exact like Gumbel-max, but Gumbel-max needs V random numbers per row:
on a 2-core CPU that is ~250 ms for 32 rows of a 262k vocabulary, against ~25 ms here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

SAMPLING_EPS = 1e-5  # temperatures below this are greedy: SamplingParams gives 0 or >= 0.01 (as vLLM)
TOPK_CAP = 256  # default static size of the lax.top_k fast path for top-k/top-p
_BLOCK = 256  # vocab block of the two-level argmax and inverse-CDF search
_NEG_INF = float("-inf")
_TINY = float(np.finfo(np.float32).tiny)  # the smallest normal float32
# bad_words (token sequences) a row may carry, and the most tokens in one: the advanced variant's arrays.
BAD_WORDS_CAP = 32
BAD_WORD_MAX_TOKENS = 16


@jax.tree_util.register_dataclass
@dataclass
class SamplingTensors:
    """Per-row sampling parameters of one step, padded to the step's row bucket S (padding rows are greedy).

    The advanced fields are placeholders of shape [S] / [S, 1] when built with advanced=False.
    """

    temperature: jax.Array  # f32[S]   < SAMPLING_EPS = greedy
    top_k: jax.Array  # i32[S]         <= 0 or >= V = off
    top_p: jax.Array  # f32[S]         1 = off
    min_p: jax.Array  # f32[S]         0 = off
    seeds: jax.Array  # u32[S]
    counter: jax.Array  # i32[S]       tokens the request already generated
    repetition_penalty: jax.Array  # f32[S]  1 = off
    presence_penalty: jax.Array  # f32[S]    0 = off
    frequency_penalty: jax.Array  # f32[S]   0 = off
    history: jax.Array  # i32[S, L]    prompt then output token ids, padded with -1
    prompt_lens: jax.Array  # i32[S]   how many of `history` are prompt tokens
    bias_ids: jax.Array  # i32[S, B]   padded with -1
    bias_values: jax.Array  # f32[S, B]
    # bool[S] rows that asked for logprobs; None (e.g. in tests): always compute them when num_logprobs is set
    want_logprobs: jax.Array | None = None
    # bool[S] rows that may sample only the tokens of their bias entries (allowed_token_ids); None: no such row
    only_biased: jax.Array | None = None
    # i32[S, W, N] each row's bad_words, right-aligned in N and padded with -1 (the last token is the one banned when
    # the output ends with the others), and i32[S, N - 1] its last output tokens, right-aligned (-1 before the
    # output's start); None: no such row
    bad_words: jax.Array | None = None
    recent_output: jax.Array | None = None
    # i32[S, M] structured outputs' masks: bit t % 32 of word t // 32 set where token t may be sampled; a row
    # without a grammar is all ones (-1), and so is a token past 32 * M. None: no such row
    token_mask: jax.Array | None = None

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]


@jax.tree_util.register_dataclass
@dataclass
class SampleOutput:
    token_ids: jax.Array  # i32[S]
    logprobs: jax.Array  # f32[S]     raw log-softmax of the sampled token (0 when num_logprobs is None)
    top_ids: jax.Array  # i32[S, K]   K = num_logprobs (0 when None)
    top_logprobs: jax.Array  # f32[S, K]


@dataclass
class RowSampling:
    """Host-side sampling state of one row: the request's parameters plus its tokens so far."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    counter: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    prompt_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: bool = False  # whether this row needs logprobs
    only_biased: bool = False  # only the tokens of logit_bias may be sampled (allowed_token_ids, as entries of 0)
    bad_words: tuple[tuple[int, ...], ...] = ()  # token sequences whose last token the output may not complete
    token_mask: np.ndarray | None = None  # i32[M]: the tokens a structured output's grammar allows (bits)

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def truncates(self) -> bool:
        """Top-k or top-p on a sampled row (greedy rows ignore them)."""
        return self.temperature >= SAMPLING_EPS and (self.top_k > 0 or self.top_p < 1.0)

    @property
    def advanced(self) -> bool:
        return (self.has_penalties or bool(self.logit_bias) or self.truncates or self.logprobs or self.only_biased
                or bool(self.bad_words) or self.token_mask is not None)  # fmt: skip


def needs_advanced(rows: list[RowSampling]) -> bool:
    """Whether any row needs the advanced variant: penalties, logit bias, allowed tokens, bad words, a token mask,
    top-k/top-p or logprobs."""
    return any(r.advanced for r in rows)


def build_sampling_tensors(
    rows: list[RowSampling], num_rows: int, history_len: int, bias_cap: int, advanced: bool, mask_words: int = 1
) -> SamplingTensors:
    """Packs rows into numpy SamplingTensors of exactly num_rows rows (history_len, bias_cap and mask_words, the
    token mask's width, ceil(V / 32) for a grammar's rows, used if advanced).

    Raises ValueError naming the field when something does not fit. The history of a row without penalties is
    left as padding: nothing reads it, and a long request without penalties must not trip the capacity.
    """
    if len(rows) > num_rows:
        raise ValueError(f"rows: {len(rows)} rows do not fit num_rows={num_rows}")
    if not advanced and needs_advanced(rows):
        raise ValueError("rows: penalties, logit_bias, allowed tokens, bad words, token masks, top_k/top_p or "
                         "logprobs need advanced=True")  # fmt: skip
    temp = np.zeros(num_rows, np.float32)  # padding rows are greedy: they never trigger the top-k/top-p path
    top_k = np.zeros(num_rows, np.int32)
    top_p = np.ones(num_rows, np.float32)
    min_p = np.zeros(num_rows, np.float32)
    seeds = np.zeros(num_rows, np.uint32)
    counter = np.zeros(num_rows, np.int32)
    rep = np.ones(num_rows, np.float32)
    pres = np.zeros(num_rows, np.float32)
    freq = np.zeros(num_rows, np.float32)
    hist_w, bias_w = (history_len, bias_cap) if advanced else (1, 1)
    history = np.full((num_rows, hist_w), -1, np.int32)
    prompt_lens = np.zeros(num_rows, np.int32)
    bias_ids = np.full((num_rows, bias_w), -1, np.int32)
    bias_values = np.zeros((num_rows, bias_w), np.float32)
    for i, r in enumerate(rows):
        if not 0 <= r.seed < 2**32:
            raise ValueError(f"seed: row {i} has seed {r.seed}, outside [0, 2**32)")
        if not 0 <= r.counter < 2**31:
            raise ValueError(f"counter: row {i} has counter {r.counter}, outside [0, 2**31)")
        # top_p below float32's normal range is 0 to the device (flushed), which would keep no token at all: the
        # smallest normal float keeps the top one, as any p that small does.
        temp[i], top_k[i], top_p[i], min_p[i] = r.temperature, r.top_k, max(r.top_p, _TINY), r.min_p
        seeds[i], counter[i] = r.seed, r.counter
        if not advanced:
            continue
        rep[i], pres[i], freq[i] = r.repetition_penalty, r.presence_penalty, r.frequency_penalty
        if r.has_penalties:
            n_prompt, n = len(r.prompt_ids), len(r.prompt_ids) + len(r.output_ids)
            if n > history_len:
                raise ValueError(f"prompt_ids/output_ids: row {i} has {n} tokens, more than history_len={history_len}")
            history[i, :n_prompt] = r.prompt_ids
            history[i, n_prompt:n] = r.output_ids
            prompt_lens[i] = n_prompt
        if len(r.logit_bias) > bias_cap:
            raise ValueError(f"logit_bias: row {i} has {len(r.logit_bias)} entries, more than bias_cap={bias_cap}")
        if r.logit_bias:
            ids, vals = zip(*r.logit_bias.items(), strict=True)
            bias_ids[i, : len(ids)] = ids
            bias_values[i, : len(ids)] = vals
    want = np.zeros(num_rows, bool)
    want[: len(rows)] = [r.logprobs for r in rows]
    only = np.zeros(num_rows, bool)
    only[: len(rows)] = [r.only_biased for r in rows]
    words, recent = _pack_bad_words(rows, num_rows, advanced)
    mask = np.full((num_rows, mask_words if advanced else 1), -1, np.int32)
    for i, r in enumerate(rows if advanced else ()):  # the basic variant has no masked row (refused above)
        if r.token_mask is not None:
            if r.token_mask.shape != (mask_words,):
                raise ValueError(f"token_mask: row {i} has shape {r.token_mask.shape}, not ({mask_words},)")
            mask[i] = r.token_mask
    return SamplingTensors(temp, top_k, top_p, min_p, seeds, counter, rep, pres, freq, history, prompt_lens, bias_ids,
                           bias_values, want, only, words, recent, mask)  # fmt: skip


def _pack_bad_words(rows: list[RowSampling], num_rows: int, advanced: bool) -> tuple[np.ndarray, np.ndarray]:
    """SamplingTensors.bad_words and .recent_output ([S, 1, 2] and [S, 1] placeholders unless advanced)."""
    width, length = (BAD_WORDS_CAP, BAD_WORD_MAX_TOKENS) if advanced else (1, 2)
    words = np.full((num_rows, width, length), -1, np.int32)
    recent = np.full((num_rows, length - 1), -1, np.int32)
    for i, r in enumerate(rows):
        if not r.bad_words:
            continue
        if len(r.bad_words) > width:
            raise ValueError(f"bad_words: row {i} has {len(r.bad_words)} token sequences, more than {width}")
        for w, word in enumerate(r.bad_words):
            if not 0 < len(word) <= length:
                raise ValueError(f"bad_words: row {i} has a sequence of {len(word)} tokens, not 1 to {length}")
            words[i, w, length - len(word) :] = word
        tail = r.output_ids[-(length - 1) :]
        recent[i, length - 1 - len(tail) :] = tail
    return words, recent


# ---------------------------------------------------------------------------------------------- device side


def sample(
    logits: jax.Array, st: SamplingTensors, *, advanced: bool, num_logprobs: int | None, topk_cap: int = TOPK_CAP
) -> SampleOutput:
    """Samples one token per row. Pure and jittable (advanced, num_logprobs and topk_cap static).

    logits: f32[S, V] (any float dtype; computed in f32) of each row's last token.
    st: the rows' parameters, already validated (SamplingParams' job): temperature >= 0, top_p in (0, 1],
        min_p in [0, 1], repetition_penalty > 0.
    advanced: the variant with logit bias, penalties (st must then carry the history and bias arrays), top-k/top-p
        and logprobs. The basic variant reads only temperature, min_p, seeds and counter: `build_sampling_tensors`
        refuses rows that need more, and its logprobs are zeros.
    num_logprobs, vLLM's `logprobs`: None = no logprobs; 0 = the sampled token's logprob only; k = also the top k.
        Logprobs are the log-softmax of the raw model logits, before bias, penalties, temperature and truncation,
        so a token forbidden by a -inf bias can still be listed with a finite logprob.
    topk_cap: candidates of the top-k/top-p fast path; rows it cannot resolve take the exact, slower bisection.
    """
    raw = logits.astype(jnp.float32)  # f32[S, V]
    num_rows, vocab = raw.shape
    if num_logprobs is not None and not 0 <= num_logprobs <= vocab:
        raise ValueError(f"num_logprobs must be None or in [0, {vocab}], got {num_logprobs}")
    k = num_logprobs or 0
    skipped = (jnp.zeros(num_rows, jnp.float32), jnp.zeros((num_rows, k), jnp.int32), jnp.zeros((num_rows, k)))
    greedy = st.temperature < SAMPLING_EPS  # bool[S]

    if not advanced:
        skipping = partial(_pick_skipping_draw, truncate=False)
        token_ids = lax.platform_dependent(raw, st, greedy, cpu=skipping, tpu=skipping, default=_pick_always_drawing)
        return SampleOutput(token_ids, *skipped)

    token_ids = _pick_skipping_draw(process_logits(raw, st), st, greedy, truncate=True, topk_cap=topk_cap)
    if num_logprobs is None:
        return SampleOutput(token_ids, *skipped)
    if st.want_logprobs is None:
        return SampleOutput(token_ids, *compute_logprobs(raw, token_ids, k))
    # Skipped at run time when no row asked: a top-k over a 262k vocabulary is not free on CPU.
    lps = lax.cond(jnp.any(st.want_logprobs), lambda: compute_logprobs(raw, token_ids, k), lambda: skipped)
    return SampleOutput(token_ids, *lps)


def _pick_skipping_draw(
    x: jax.Array, st: SamplingTensors, greedy: jax.Array, *, truncate: bool, topk_cap: int = TOPK_CAP
) -> jax.Array:
    """Greedy rows take the argmax, the others a draw, which an all-greedy step skips under a conditional: the
    advanced variant everywhere, and the basic one (without `truncate`) where a conditional is evaluated on the
    device (CPU, TPU). x f32[S, V] processed logits, greedy bool[S] -> i32[S]."""
    zeros = jnp.zeros(x.shape[0], jnp.int32)
    block_max = _block_max(x)  # shared by the argmax and the draw: one pass over the logits fewer
    draw = partial(_draw, truncate=truncate, topk_cap=topk_cap)
    drawn = lax.cond(jnp.any(~greedy), draw, lambda *_: zeros, x, st, greedy, block_max)
    return jnp.where(greedy, _argmax_rows(x, block_max), drawn)


def _pick_always_drawing(x: jax.Array, st: SamplingTensors, greedy: jax.Array) -> jax.Array:
    """The basic variant without a conditional (GPU: see the module's docstring); the same tokens as
    `_pick_skipping_draw`, row for row."""
    block_max = _block_max(x)
    return jnp.where(greedy, _argmax_rows(x, block_max), _draw(x, st, greedy, block_max, truncate=False))


def compute_logprobs(raw: jax.Array, token_ids: jax.Array, k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """raw f32[S, V], token_ids i32[S] -> (logprob f32[S], top ids i32[S, k], top logprobs f32[S, k])."""
    raw = raw.astype(jnp.float32)  # a model of one's own may return bfloat16 logits: the softmax in bf16 lost ~6e-2
    # Same formula as jax.nn.log_softmax, without materialising the [S, V] result.
    shifted = raw - jnp.max(raw, axis=-1, keepdims=True)  # f32[S, V]
    log_z = jnp.log(jnp.sum(jnp.exp(shifted), axis=-1))  # f32[S]
    logprobs = jnp.take_along_axis(shifted, token_ids[:, None], axis=-1)[:, 0] - log_z
    top_vals, top_ids = _top_k(shifted, k)
    return logprobs, top_ids.astype(jnp.int32), top_vals - log_z[:, None]


def target_ranks(raw: jax.Array, token_ids: jax.Array) -> jax.Array:
    """raw f32[S, V], token_ids i32[S] -> i32[S]: each token's rank in its row, 1 = the most likely. Tokens tied
    with it count as ahead of it, as vLLM ranks."""
    raw = raw.astype(jnp.float32)
    own = jnp.take_along_axis(raw, token_ids[:, None], axis=-1)  # f32[S, 1]
    return jnp.sum(raw >= own, axis=-1, dtype=jnp.int32)


def process_logits(logits: jax.Array, st: SamplingTensors) -> jax.Array:
    """Logit bias then penalties (steps 2-3 above), on f32[S, V] logits -> f32[S, V]. Greedy takes its argmax."""
    x = logits.astype(jnp.float32)
    num_rows, vocab = x.shape
    rows = jnp.arange(num_rows)[:, None]
    # Out-of-vocab ids (and the -1 padding) point past the vocab and are dropped by the scatter.
    bias_ids = jnp.where((st.bias_ids >= 0) & (st.bias_ids < vocab), st.bias_ids, vocab)  # i32[S, B]
    x = x.at[rows, bias_ids].add(st.bias_values, mode="drop")
    if st.only_biased is not None:  # allowed_token_ids: every token without a bias entry is out
        x = lax.cond(jnp.any(st.only_biased), _keep_biased, lambda x, ids, only: x, x, bias_ids, st.only_biased)
    if st.bad_words is not None:
        x = lax.cond(jnp.any(st.bad_words[:, :, -1] >= 0), _ban_bad_words, lambda x, st: x, x, st)
    if st.token_mask is not None:
        x = lax.cond(jnp.any(st.token_mask != -1), _apply_token_mask, lambda x, m: x, x, st.token_mask)
    active = (st.repetition_penalty != 1.0) | (st.presence_penalty != 0.0) | (st.frequency_penalty != 0.0)
    # The scatters below build two [S, V] arrays: skip them when no row has a penalty.
    return lax.cond(jnp.any(active), _apply_penalties, lambda x, st: x, x, st)


def _keep_biased(x: jax.Array, bias_ids: jax.Array, only_biased: jax.Array) -> jax.Array:
    """x f32[S, V] -> f32[S, V]: -inf outside the bias entries (i32[S, B], the vocab size where none) in the rows
    marked only_biased (bool[S])."""
    rows = jnp.arange(x.shape[0])[:, None]
    listed = jnp.zeros(x.shape, bool).at[rows, bias_ids].set(True, mode="drop")
    return jnp.where(only_biased[:, None] & ~listed, _NEG_INF, x)


def _apply_token_mask(x: jax.Array, mask: jax.Array) -> jax.Array:
    """x f32[S, V] -> f32[S, V]: -inf where the row's mask (i32[S, M], one bit per token) has the token's bit clear;
    tokens past 32 * M are kept."""
    num_rows, vocab = x.shape
    bits = (mask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # i32[S, M, 32]: bit b of word w is token 32w+b
    allowed = bits.reshape(num_rows, -1)[:, :vocab] != 0
    if allowed.shape[1] < vocab:
        allowed = jnp.pad(allowed, ((0, 0), (0, vocab - allowed.shape[1])), constant_values=True)
    return jnp.where(allowed, x, _NEG_INF)


def _ban_bad_words(x: jax.Array, st: SamplingTensors) -> jax.Array:
    """x f32[S, V] -> f32[S, V]: -inf on the last token of every bad word whose other tokens end the output (vLLM's
    bad_words: the output's tokens only, not the prompt's)."""
    num_rows, vocab = x.shape
    words = st.bad_words  # i32[S, W, N]
    before = words[:, :, :-1]  # right-aligned like recent_output, -1 where the word is shorter
    ends_output = jnp.all((before < 0) | (before == st.recent_output[:, None, :]), axis=-1)  # bool[S, W]
    last = words[:, :, -1]
    banned = jnp.where(ends_output & (last >= 0) & (last < vocab), last, vocab)  # vocab: dropped by the scatter
    return x.at[jnp.arange(num_rows)[:, None], banned].set(_NEG_INF, mode="drop")


def _apply_penalties(x: jax.Array, st: SamplingTensors) -> jax.Array:
    """x f32[S, V] -> f32[S, V]. With penalties 1/0/0 a row comes out unchanged bit for bit."""
    num_rows, vocab = x.shape
    ids = st.history  # i32[S, L]
    valid = (ids >= 0) & (ids < vocab)
    is_output = valid & (jnp.arange(ids.shape[1])[None, :] >= st.prompt_lens[:, None])  # bool[S, L]
    ids = jnp.where(valid, ids, vocab)
    rows = jnp.arange(num_rows)[:, None]
    seen = jnp.zeros((num_rows, vocab), jnp.bool_).at[rows, ids].set(True, mode="drop")  # in prompt or output
    counts = jnp.zeros((num_rows, vocab), jnp.float32).at[rows, ids].add(is_output.astype(jnp.float32), mode="drop")
    rep = st.repetition_penalty[:, None]
    x = jnp.where(seen, jnp.where(x > 0, x / rep, x * rep), x)
    x = x - st.frequency_penalty[:, None] * counts
    return x - st.presence_penalty[:, None] * (counts > 0).astype(jnp.float32)


def _draw(
    x: jax.Array,
    st: SamplingTensors,
    greedy: jax.Array,
    block_max: jax.Array,
    *,
    truncate: bool,
    topk_cap: int = TOPK_CAP,
) -> jax.Array:
    """Steps 5-8 for the non-greedy rows: x f32[S, V] processed logits, greedy bool[S], block_max f32[S, NB]
    (`_block_max(x)`) -> i32[S]. Without `truncate` (the basic variant) top-k and top-p are not applied."""
    vocab = x.shape[1]
    temperature = jnp.where(greedy, 1.0, st.temperature)[:, None]  # f32[S, 1]
    # Dividing by a positive number is monotone, also once rounded: the row max of x / t is max(x) / t exactly.
    row_max = jnp.max(block_max, axis=-1, keepdims=True) / temperature  # f32[S, 1]
    # min-p: keep p >= min_p * p_max, i.e. logit >= max + log(min_p); log(0) = -inf keeps everything.
    floor = row_max + jnp.log(st.min_p)[:, None]
    keys = jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(st.seeds, st.counter)
    u = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys)  # f32[S] in [0, 1)
    if not truncate:
        # The basic variant never builds the scaled, masked [S, V] logits: the draw recomputes their masses block
        # by block from x (a 128-row step of a 49k vocabulary would otherwise write and read 3 more 25 MB arrays).
        return _inverse_cdf(x, u, _Masses(temperature, floor, row_max))
    x = x / temperature
    x = jnp.where(x >= floor, x, _NEG_INF)
    k_on = (st.top_k > 0) & (st.top_k < vocab)
    rows = ~greedy & (k_on | (st.top_p < 1.0))  # bool[S]
    x = lax.cond(jnp.any(rows), partial(_truncate, topk_cap=topk_cap), lambda x, *_: x, x, st, rows)
    return _inverse_cdf(x, u, _Masses.of_logits(row_max))  # truncation keeps the row max


def _truncate(x: jax.Array, st: SamplingTensors, truncate: jax.Array, *, topk_cap: int) -> jax.Array:
    """Top-k then top-p on x f32[S, V] for the rows where truncate bool[S]; others pass through unchanged.

    Fast path: the top `topk_cap` values of each row, enough when top_k <= cap and the top-p cut-off falls inside
    them. Any other row gets its thresholds by bisection over the float order (64 passes over the row, no sort:
    sorting 262k logits per row costs seconds on CPU). A row that the fast path resolves always uses the fast
    result, whatever its neighbours need, so the fallback cannot change its token.
    """
    vocab = x.shape[1]
    k = jnp.where((st.top_k > 0) & (st.top_k < vocab), st.top_k, vocab)  # i32[S], vocab = off
    cap = min(topk_cap, vocab)
    thr, resolved = _thresholds_from_top(x, _top_k(x, cap)[0], k, st.top_p)
    if cap < vocab:
        thr = lax.cond(
            jnp.all(resolved | ~truncate),
            lambda: thr,
            lambda: jnp.where(resolved, thr, _thresholds_by_bisection(x, k, st.top_p)),
        )
    thr = jnp.where(truncate, thr, _NEG_INF)
    return jnp.where(x >= thr[:, None], x, _NEG_INF)


def _top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """lax.top_k of x f32[S, V] -> (f32[S, k], i32[S, k]). The barrier matters: when the outputs fuse into a
    consumer, XLA CPU decomposes TopK into a full sort of the row (1.6 s instead of 16 ms at 32 x 262k).
    NOTE: one barrier per output. A barrier over the (values, indices) pair becomes a direct user of the TopK
    tuple, which crashes XLA's TopkDecomposer in multi-device (SPMD) programs."""
    vals, idx = lax.top_k(x, k)
    return lax.optimization_barrier(vals), lax.optimization_barrier(idx)


def _thresholds_from_top(x: jax.Array, vals: jax.Array, k: jax.Array, top_p: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x f32[S, V]; vals f32[S, C] its C largest values, descending; k i32[S] (V = off); top_p f32[S].

    Returns (threshold f32[S]: keep logits >= it, resolved bool[S]: whether C values were enough to know it).
    """
    num_cand, vocab = vals.shape[1], x.shape[1]
    kth = jnp.take_along_axis(vals, jnp.minimum(k, num_cand)[:, None] - 1, axis=-1)[:, 0]
    kth = jnp.where(k < vocab, kth, _NEG_INF)  # f32[S]
    # Top-p mass is measured on the top-k survivors, normalised over the whole row (not just the C candidates).
    row_max = vals[:, 0]
    z = jnp.sum(jnp.where(x >= kth[:, None], jnp.exp(x - row_max[:, None]), 0.0), axis=-1)  # f32[S]
    e = jnp.where(vals >= kth[:, None], jnp.exp(vals - row_max[:, None]), 0.0)  # f32[S, C]
    inclusive = jnp.cumsum(e, axis=-1)
    exclusive = jnp.pad(inclusive[:, :-1], ((0, 0), (1, 0)))  # mass strictly before each candidate
    target = top_p * z
    # A candidate stays while the mass before it is < p; the survivors are a prefix (the sums never decrease).
    n_keep = jnp.sum(exclusive < target[:, None], axis=-1)
    thr_p = jnp.take_along_axis(vals, jnp.clip(n_keep - 1, 0, num_cand - 1)[:, None], axis=-1)[:, 0]
    p_on = top_p < 1.0
    thr = jnp.where(p_on, jnp.maximum(kth, thr_p), kth)
    resolved = (k <= num_cand) & (~p_on | (inclusive[:, -1] >= target))
    return thr, resolved


def _order_key(x: jax.Array) -> jax.Array:
    """f32[...] -> u32[...] whose unsigned order is the float order (NaN aside), so bisection can halve ints."""
    b = lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(b >> 31 == 1, ~b, b | jnp.uint32(0x80000000))


def _key_to_float(key: jax.Array) -> jax.Array:
    """Inverse of _order_key: u32[...] -> f32[...]."""
    b = jnp.where(key >> 31 == 1, key & jnp.uint32(0x7FFFFFFF), ~key)
    return lax.bitcast_convert_type(b, jnp.float32)


def _smallest_key(lo: jax.Array, hi: jax.Array, pred: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """Smallest t in [lo, hi] (u32[S] each) with pred(t) bool[S], for pred monotone in t and true at hi.
    32 halvings cover the whole u32 range."""

    def body(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        ok = pred(mid)
        return jnp.where(ok, lo, mid + 1), jnp.where(ok, mid, hi)

    return lax.fori_loop(0, 32, body, (lo, hi))[0]


def _thresholds_by_bisection(x: jax.Array, k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Exact top-k/top-p thresholds f32[S] of x f32[S, V] without sorting. k i32[S] (V = off), top_p f32[S]."""
    vocab = x.shape[1]
    keys = _order_key(x)  # u32[S, V]
    lo = jnp.full(x.shape[0], _order_key(jnp.float32(_NEG_INF)))
    hi = jnp.max(keys, axis=-1)
    k_on, p_on = k < vocab, top_p < 1.0
    # Each search is 32 passes over the rows: run it only when some row uses it (the others ignore its result).
    # k-th largest value: the smallest t with fewer than k values above it.
    t_k = lax.cond(
        jnp.any(k_on), lambda: _smallest_key(lo, hi, lambda t: jnp.sum(keys > t[:, None], axis=-1) < k), lambda: lo
    )
    kth = jnp.where(k_on, _key_to_float(t_k), _NEG_INF)
    # Top-p cut-off: the smallest t such that the mass above it is < p (the tie group at t keeps the mass >= p).
    e = jnp.where(x >= kth[:, None], jnp.exp(x - jnp.max(x, axis=-1, keepdims=True)), 0.0)  # f32[S, V]
    target = top_p * jnp.sum(e, axis=-1)
    t_p = lax.cond(
        jnp.any(p_on),
        lambda: _smallest_key(lo, hi, lambda t: jnp.sum(jnp.where(keys > t[:, None], e, 0.0), axis=-1) < target),
        lambda: lo,
    )
    return jnp.where(p_on, jnp.maximum(kth, _key_to_float(t_p)), kth)


def _blocks(a: jax.Array, fill: float) -> jax.Array:
    """[S, V] -> [S, ceil(V / _BLOCK), _BLOCK], the tail padded with fill."""
    num_rows, vocab = a.shape
    num_blocks = -(-vocab // _BLOCK)
    a = jnp.pad(a, ((0, 0), (0, num_blocks * _BLOCK - vocab)), constant_values=fill)
    return a.reshape(num_rows, num_blocks, _BLOCK)


def _block_max(x: jax.Array) -> jax.Array:
    """The max of each _BLOCK-wide block of x f32[S, V] -> f32[S, ceil(V / _BLOCK)]."""
    return jnp.max(_blocks(x, _NEG_INF), axis=-1)


def _argmax_rows(x: jax.Array, block_max: jax.Array) -> jax.Array:
    """jnp.argmax(x, -1) for x f32[S, V] -> i32[S] (first index of the max), in two levels from its block maxima
    (`_block_max(x)`): XLA's CPU argmax over a long row is ~10x slower than a max over blocks followed by an
    argmax inside the winning block."""
    block = jnp.argmax(block_max, axis=-1)  # first block holding the row max
    inner = _block_of(_blocks(x, _NEG_INF), block)  # f32[S, BLOCK]
    return (block * _BLOCK + jnp.argmax(inner, axis=-1)).astype(jnp.int32)


def _block_of(blocks: jax.Array, block: jax.Array) -> jax.Array:
    """blocks f32[S, NB, BLOCK], block i32[S] -> each row's block f32[S, BLOCK]."""
    return jnp.take_along_axis(blocks, block[:, None, None], axis=1)[:, 0]


@dataclass(frozen=True)
class _Masses:
    """Unnormalised probabilities of logits x: exp(x / temperature - row_max) where x / temperature >= floor, else
    0. Every field is f32[S, 1], broadcast over a row's logits. Evaluated elementwise, so the same logit gives the
    same mass in whichever slice of the row it is computed."""

    temperature: jax.Array
    floor: jax.Array
    row_max: jax.Array

    @staticmethod
    def of_logits(row_max: jax.Array) -> _Masses:
        """softmax's masses, exp(x - row_max), of final logits (masked ones -inf) whose row max is row_max."""
        return _Masses(jnp.ones_like(row_max), jnp.full_like(row_max, _NEG_INF), row_max)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x f32[S, ...] -> f32[S, ...]."""
        lead = (x.shape[0],) + (1,) * (x.ndim - 1)
        y = x / self.temperature.reshape(lead)
        return jnp.where(y >= self.floor.reshape(lead), jnp.exp(y - self.row_max.reshape(lead)), 0.0)


def _inverse_cdf(x: jax.Array, u: jax.Array, masses: _Masses | None = None) -> jax.Array:
    """Draws from the distribution `masses` gives the logits x f32[S, V] (None: softmax(x), x masked with -inf),
    u f32[S] uniform in [0, 1) -> i32[S].

    Returns the first token whose cumulative mass exceeds u * total, found block by block so the scans are short.
    The masses are reduced per block as they are computed and recomputed for the one block a row's draw falls in,
    so no [S, V] array of them is ever written. A token with zero mass can never be that first token, so masked
    tokens are never drawn.
    """
    vocab = x.shape[1]
    if masses is None:
        masses = _Masses.of_logits(jnp.max(x, axis=-1, keepdims=True))
    xb = _blocks(x, _NEG_INF)  # f32[S, NB, BLOCK]; -inf padding has zero mass
    num_blocks = xb.shape[1]
    block_cum = jnp.cumsum(jnp.sum(masses(xb), axis=-1), axis=-1)  # f32[S, NB]
    target = u * block_cum[:, -1]  # < total for u < 1, so some block exceeds it
    block = jnp.minimum(jnp.sum(block_cum <= target[:, None], axis=-1), num_blocks - 1)  # i32[S]
    before = jnp.take_along_axis(block_cum, jnp.maximum(block - 1, 0)[:, None], axis=-1)[:, 0]
    before = jnp.where(block > 0, before, 0.0)
    inner = masses(_block_of(xb, block))  # f32[S, BLOCK]
    j = jnp.sum(jnp.cumsum(inner, axis=-1) <= (target - before)[:, None], axis=-1)
    # The in-block sum can end an ulp below the block total it was found by: never step past the block's last token
    # with mass.
    last = jnp.max(jnp.where(inner > 0, jnp.arange(_BLOCK), 0), axis=-1)
    return jnp.minimum(block * _BLOCK + jnp.minimum(j, last), vocab - 1).astype(jnp.int32)
