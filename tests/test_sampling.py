"""jaxinfer.sampling against numpy references of vLLM's semantics: distributions, greedy, batch invariance,
penalties and bias, logprobs, one compilation per variant, and the host-side packing."""

from __future__ import annotations

import re
from dataclasses import replace
from functools import partial

import jax
import numpy as np
import pytest

from jaxinfer import sampling
from jaxinfer.sampling import (
    TOPK_CAP,
    RowSampling,
    SamplingTensors,
    build_sampling_tensors,
    needs_advanced,
    process_logits,
    sample,
)
from tests.control_flow import host_synced_control_flow

try:
    from scipy import stats
except ImportError:  # fall back to a per-token deviation bound
    stats = None

_sample = jax.jit(sample, static_argnames=("advanced", "num_logprobs", "topk_cap"))
_process = jax.jit(process_logits)

HIST, BIAS = 64, 8  # history and bias capacities of the advanced tests
# 12 tokens, deliberately not sorted by id, with every cut-off used below well away from a boundary.
LOGITS12 = np.array([0.3, 2.0, -1.5, 1.0, -0.4, 1.5, -4.0, 0.0, 1.2, -0.9, 0.6, -2.5], np.float32)


# ---------------------------------------------------------------------------------------------- references


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def ref_probs(logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0):
    """f64[V] distribution vLLM v1 samples from: temperature -> min-p -> top-k -> top-p (float64, by sorting)."""
    x = logits.astype(np.float64) / temperature
    if min_p > 0:
        p = _softmax(x)
        x = np.where(p >= min_p * p.max(), x, -np.inf)
    if 0 < top_k < len(x):
        x = np.where(x >= np.sort(x)[::-1][top_k - 1], x, -np.inf)
    if top_p < 1:
        p = _softmax(x)
        order = np.argsort(-x, kind="stable")
        mass_before = np.cumsum(p[order]) - p[order]
        n_keep = int(np.sum(mass_before < top_p))
        x = np.where(x >= x[order[n_keep - 1]], x, -np.inf)
    return _softmax(x)


def ref_process(logits: np.ndarray, row: RowSampling) -> np.ndarray:
    """f32[V]: logit bias, then repetition (prompt + output), frequency and presence (output only) penalties."""
    x = logits.astype(np.float32).copy()
    for tok, b in row.logit_bias.items():
        x[tok] += np.float32(b)
    counts = np.bincount(np.asarray(row.output_ids, np.int64), minlength=len(x)).astype(np.float32)
    rep = np.float32(row.repetition_penalty)
    for tok in set(row.prompt_ids) | set(row.output_ids):
        x[tok] = x[tok] / rep if x[tok] > 0 else x[tok] * rep
    x = x - np.float32(row.frequency_penalty) * counts
    return x - np.float32(row.presence_penalty) * (counts > 0).astype(np.float32)


def assert_frequencies(tokens: np.ndarray, probs: np.ndarray) -> None:
    """Empirical token frequencies match probs; tokens with probability 0 never appear."""
    n = len(tokens)
    counts = np.bincount(tokens, minlength=len(probs))
    assert len(counts) == len(probs), "token id out of range"
    support = probs > 0
    assert counts[~support].sum() == 0, f"forbidden tokens drawn: {np.nonzero(counts * ~support)[0]}"
    if support.sum() == 1:
        return
    expected = probs[support] / probs[support].sum() * n
    if stats is not None:
        pvalue = stats.chisquare(counts[support], expected).pvalue
        assert pvalue > 1e-4, f"chi-square p={pvalue:.2g}\nobserved {counts[support]}\nexpected {expected.round(1)}"
    else:  # each count within 5 standard deviations of its binomial mean
        p = expected / n
        assert np.all(np.abs(counts[support] - expected) <= 5 * np.sqrt(n * p * (1 - p)) + 1)


def _rows(n: int, **params) -> list[RowSampling]:
    """n rows sharing params, seed = row index (unless given)."""
    return [RowSampling(**{"seed": i, **params}) for i in range(n)]


def _tokens(logits: np.ndarray, rows: list[RowSampling], topk_cap: int = TOPK_CAP) -> np.ndarray:
    """Sampled tokens of `rows` in the variant the engine picks for them (`needs_advanced`)."""
    advanced = needs_advanced(rows)
    st = build_sampling_tensors(rows, len(rows), HIST, BIAS, advanced)
    return np.asarray(_sample(logits, st, advanced=advanced, num_logprobs=None, topk_cap=topk_cap).token_ids)


# ---------------------------------------------------------------------------------------------- distributions

CONFIGS = {  # temperature, top_k, top_p, min_p
    "t1": (1.0, 0, 1.0, 0.0),
    "t0.6": (0.6, 0, 1.0, 0.0),
    "t1.7": (1.7, 0, 1.0, 0.0),
    "top_k4": (1.0, 4, 1.0, 0.0),
    "top_p0.75": (1.0, 0, 0.75, 0.0),
    "min_p0.15": (1.0, 0, 1.0, 0.15),
    "k6_p0.8_t0.8": (0.8, 6, 0.8, 0.0),
    "p0.72_min_p0.2": (1.0, 0, 0.72, 0.2),  # vLLM's order (min-p first) keeps 3 tokens, top-p first would keep 4
    "all": (1.3, 5, 0.9, 0.05),
}


@pytest.mark.parametrize("topk_cap", [TOPK_CAP, 3], ids=["fast_path", "bisection"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_distribution(name: str, topk_cap: int):
    temperature, top_k, top_p, min_p = CONFIGS[name]
    probs = ref_probs(LOGITS12, temperature, top_k, top_p, min_p)
    for dp in (-0.01, 0.01):  # the reference's support is not on a knife edge
        nudged = ref_probs(LOGITS12, temperature, top_k, top_p + dp if top_p < 1 else 1.0, min_p + dp if min_p else 0.0)
        assert np.array_equal(probs > 0, nudged > 0)
    n = 20000
    rows = _rows(n, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, counter=5)
    assert needs_advanced(rows) == (top_k > 0 or top_p < 1)  # the basic variant has no truncation
    assert_frequencies(_tokens(np.tile(LOGITS12, (n, 1)), rows, topk_cap), probs)


def test_order_is_vllm():
    """min-p runs before top-p: the other order gives a different support for this config."""
    x = LOGITS12.astype(np.float64)
    p = _softmax(x)
    o = np.argsort(-x, kind="stable")
    top_p_first = x >= x[o[int(np.sum(np.cumsum(p[o]) - p[o] < 0.72)) - 1]]
    top_p_first &= p >= 0.2 * p.max()
    assert top_p_first.sum() == 4 and (ref_probs(LOGITS12, 1.0, 0, 0.72, 0.2) > 0).sum() == 3


def test_distribution_over_counters():
    """One seed, successive counters: the draws of one request follow the distribution too."""
    n = 20000
    rows = [RowSampling(temperature=1.0, top_k=4, seed=42, counter=c) for c in range(n)]
    assert_frequencies(_tokens(np.tile(LOGITS12, (n, 1)), rows), ref_probs(LOGITS12, 1.0, 4))


@pytest.mark.parametrize(
    "params",
    [dict(temperature=1.0), dict(temperature=0.9, top_k=6, top_p=0.95), dict(top_p=0.7), dict(min_p=0.2, top_k=3)],
    ids=["plain", "k6_p0.95", "p0.7", "min_p_k3"],
)
def test_distribution_across_blocks(params: dict):
    """A 1000-token vocab whose mass sits in a few tokens spread over several 256-token blocks (and the padded
    last block): exercises the blocked inverse-CDF search, and with topk_cap=4 the bisection fallback."""
    vocab, n, reps = 1000, 4000, 4
    ids = np.array([0, 255, 256, 300, 511, 512, 767, 990, 999])
    logits = np.full(vocab, -np.inf, np.float32)
    logits[ids] = [0.5, 1.4, -0.3, 1.0, 0.2, 1.6, -1.0, 0.8, 1.1]
    tokens = []
    for counter in range(reps):
        tokens.append(_tokens(np.tile(logits, (n, 1)), _rows(n, counter=counter, **params), topk_cap=4))
    full = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, **params}
    assert_frequencies(np.concatenate(tokens), ref_probs(logits, **full))


def test_inverse_cdf_extreme_uniforms_never_draw_masked_tokens():
    """u at the ends of [0, 1): the in-block cumulative sum can end a few ulps below the block total it was found
    by (hundreds of these 2048 rows at u = 1 - 2**-23); the draw must still land on a token with mass."""
    rows, vocab = 2048, 512
    x = (np.random.default_rng(7).standard_normal((rows, vocab)) * 3).astype(np.float32)
    x[:, :5] = x[:, 200:256] = x[:, 356:] = -np.inf  # masked head, block tail and last block
    draw = jax.jit(sampling._inverse_cdf)
    for u in [0.0, 1 - 2**-22, 1 - 2**-23]:
        tokens = np.asarray(draw(x, np.full(rows, u, np.float32)))
        assert np.isfinite(x[np.arange(rows), tokens]).all(), u
    first = np.asarray(draw(x, np.zeros(rows, np.float32)))
    np.testing.assert_array_equal(first, 5)


@pytest.mark.parametrize("rows, vocab", [(16, 8192), (64, 49152)])
def test_a_sampled_basic_step_materialises_at_most_one_array_of_the_logits_size(rows, vocab):
    """The basic draw recomputes the masses of the block a row's draw falls in instead of keeping the scaled,
    masked logits and their exponentials as [S, V] arrays (at 128 rows of a 49k vocabulary each was 25 MB written
    and read again at every sampled step). What XLA still materialises is one [S, V] input to its block sums."""
    rs = [RowSampling(temperature=1.0, min_p=0.05, seed=i) for i in range(rows)]
    st = build_sampling_tensors(rs, rows, 1, 1, advanced=False)
    step = jax.jit(lambda lg, st: sample(lg, st, advanced=False, num_logprobs=None).token_ids)
    compiled = step.lower(jax.ShapeDtypeStruct((rows, vocab), np.float32), st).compile()
    one_array = rows * vocab * 4
    assert compiled.memory_analysis().temp_size_in_bytes < 1.5 * one_array


# ---------------------------------------------------------------------------------------------- greedy

S8, V1000 = 8, 1000  # shared shape of the greedy, logprobs, penalty and batch-invariance tests (one compile each)


def _logits(seed: int, rows: int, vocab: int = V1000, scale: float = 1.5) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((rows, vocab)) * scale).astype(np.float32)


def test_greedy_and_mixed_rows():
    lg = _logits(0, S8)
    lg[3, [20, 700]] = lg[3].max() + 1.0  # a tie: the first index wins, as np.argmax
    lg[5, 999] = lg[5].max() + 1.0  # max in the padded last block
    lg[7, 0] = lg[7].max() + 1.0
    rows = [
        RowSampling(temperature=0.0),
        RowSampling(temperature=0.0, top_k=1, top_p=0.1, min_p=0.5, seed=3),  # truncation ignored when greedy
        RowSampling(temperature=1e-6),  # below vLLM's epsilon: greedy
        RowSampling(temperature=0.0),
        RowSampling(temperature=1.0, top_k=1, seed=4),  # sampled, but only the argmax survives
        RowSampling(temperature=0.0),
        RowSampling(temperature=1.0, top_k=2, seed=5),
        RowSampling(temperature=0.0),
    ]
    argmax = np.argmax(lg, axis=-1)
    assert argmax[3] == 20 and argmax[5] == 999 and argmax[7] == 0
    got = _tokens(lg, rows)
    np.testing.assert_array_equal(got[[0, 1, 2, 3, 4, 5, 7]], argmax[[0, 1, 2, 3, 4, 5, 7]])
    assert got[6] in np.argsort(-lg[6])[:2]
    # All rows greedy takes the no-draw branch, in both variants, and gives the same tokens; so does the basic
    # variant's form without a conditional (what a GPU runs).
    greedy = [RowSampling(temperature=0.0)] * S8
    for advanced in (False, True):
        got = _sample(lg, build_sampling_tensors(greedy, S8, HIST, BIAS, advanced), advanced=advanced, num_logprobs=20)
        np.testing.assert_array_equal(np.asarray(got.token_ids), argmax)
    st = build_sampling_tensors(greedy, S8, HIST, BIAS, False)
    always = jax.jit(sampling._pick_always_drawing)(lg, st, st.temperature < sampling.SAMPLING_EPS)
    np.testing.assert_array_equal(np.asarray(always), argmax)


@pytest.mark.parametrize("top_p", [1e-40, 1e-38, 1e-30])
def test_a_top_p_too_small_for_float32_keeps_the_top_token(top_p):
    """top_p is in (0, 1]; one below float32's normal range was 0 on the device, kept nothing and sampled token 0."""
    lg = _logits(1, S8)
    rows = [RowSampling(temperature=1.0, top_p=top_p, seed=i) for i in range(S8)]
    np.testing.assert_array_equal(_tokens(lg, rows), np.argmax(lg, axis=-1))


# ---------------------------------------------------------------------------------------------- batch invariance

TARGETS = [
    RowSampling(temperature=1.0, seed=7),
    RowSampling(temperature=0.7, top_k=40, seed=2**32 - 1, counter=3),
    RowSampling(temperature=1.2, top_p=0.9, seed=11, counter=100),
    RowSampling(temperature=1.0, min_p=0.05, seed=12, counter=1),
    RowSampling(temperature=0.9, top_k=300, top_p=0.95, seed=13, counter=2),  # k > TOPK_CAP: bisection
    RowSampling(temperature=1.5, top_p=0.99, seed=14, counter=9),  # nucleus wider than the cap: bisection
    RowSampling(temperature=0.0),
    RowSampling(temperature=2.0, top_k=5, top_p=0.8, min_p=0.01, seed=15, counter=2**31 - 1),
]


def _with_penalties(row: RowSampling, i: int) -> RowSampling:
    """The advanced variant of a target: its own penalties and bias over a fixed history."""
    if i % 2 == 0:
        return row
    hist = np.random.default_rng(100 + i).integers(0, V1000, 40).tolist()
    return replace(
        row,
        repetition_penalty=1.3,
        presence_penalty=0.4,
        frequency_penalty=0.2,
        prompt_ids=hist[:25],
        output_ids=hist[25:],
        logit_bias={i: 3.0, 500 + i: -float("inf")},
    )


def _neighbour(rng: np.random.Generator, variant: str) -> RowSampling:
    kinds = [
        dict(temperature=0.0),
        dict(temperature=float(rng.uniform(0.2, 2.0))),
        dict(temperature=1.0, min_p=float(rng.uniform(0.0, 0.5))),
        dict(temperature=1.0, top_k=int(rng.integers(1, 600))),
        dict(temperature=1.0, top_p=float(rng.uniform(0.3, 1.0))),
        dict(temperature=1.0, min_p=float(rng.uniform(0.0, 0.5)), top_p=0.999),
        dict(temperature=0.5, top_k=400, top_p=0.97),
    ]
    params = kinds[rng.integers(0, 3 if variant == "basic" else len(kinds))]
    row = RowSampling(seed=int(rng.integers(0, 2**32)), counter=int(rng.integers(0, 1000)), **params)
    if variant == "penalties" and rng.integers(0, 2):
        row.repetition_penalty, row.frequency_penalty = 1.5, 0.5
        row.prompt_ids, row.output_ids = rng.integers(0, V1000, 30).tolist(), rng.integers(0, V1000, 20).tolist()
        row.logit_bias = {int(t): -float("inf") for t in rng.integers(0, V1000, 5)}
    return row


def _variant_targets(variant: str) -> list[RowSampling]:
    if variant == "basic":
        return [r for r in TARGETS if not r.truncates] + [
            RowSampling(temperature=0.5, seed=21, counter=4),
            RowSampling(temperature=1.7, seed=22),
            RowSampling(temperature=1.3, min_p=0.2, seed=23, counter=2**31 - 1),
        ]
    return [_with_penalties(r, i) for i, r in enumerate(TARGETS)] if variant == "penalties" else TARGETS


@pytest.mark.parametrize("variant", ["basic", "truncation", "penalties"])
def test_batch_invariance(variant: str):
    """A row's token depends on its logits, parameters, seed and counter only: not on the batch size, its row
    index or its neighbours' parameters (which switch the all-greedy, truncation and bisection branches)."""
    advanced = variant != "basic"
    targets = _variant_targets(variant)
    lg = _logits(1, len(targets))

    def run(rows: list[RowSampling], logits: np.ndarray) -> np.ndarray:
        st = build_sampling_tensors(rows, len(rows), HIST, BIAS, advanced)
        return np.asarray(_sample(logits, st, advanced=advanced, num_logprobs=20).token_ids)

    alone = np.array([run([r], lg[i : i + 1])[0] for i, r in enumerate(targets)])
    assert len(set(alone.tolist())) > len(targets) // 2 and np.sum(alone != np.argmax(lg, -1)) >= len(targets) // 2
    np.testing.assert_array_equal(run(targets, lg), alone)
    rng = np.random.default_rng(2)
    for _ in range(2):
        size = 48
        pos = rng.permutation(size)[: len(targets)]
        rows = [_neighbour(rng, variant) for _ in range(size)]
        logits = _logits(int(rng.integers(1 << 30)), size)
        for i, p in enumerate(pos):
            rows[p], logits[p] = targets[i], lg[i]
        np.testing.assert_array_equal(run(rows, logits)[pos], alone)


def test_basic_rows_draw_the_same_in_every_variant_and_form():
    """Greedy, temperature and min-p rows: the basic variant (as CPU and TPU run it, skipping the draw when all rows
    are greedy, and as a GPU runs it, always drawing) and the advanced variant beside truncating neighbours give
    the same tokens: which program a step runs never changes a row's token."""
    targets = _variant_targets("basic")
    rng = np.random.default_rng(3)
    size = 24
    pos = rng.permutation(size)[: len(targets)]
    rows = [_neighbour(rng, "basic") for _ in range(size)]
    logits = _logits(4, size)
    for i, p in enumerate(pos):
        rows[p] = targets[i]
    st = build_sampling_tensors(rows, size, HIST, BIAS, False)
    basic = np.asarray(_sample(logits, st, advanced=False, num_logprobs=None).token_ids)
    always = np.asarray(jax.jit(sampling._pick_always_drawing)(logits, st, st.temperature < sampling.SAMPLING_EPS))
    np.testing.assert_array_equal(always, basic)
    assert np.sum(basic != np.argmax(logits, -1)) >= size // 3  # the draws are not trivial
    with_truncation = rows + [RowSampling(temperature=1.0, top_k=5, top_p=0.9, seed=1)]
    adv = build_sampling_tensors(with_truncation, size + 1, HIST, BIAS, True)
    advanced = _sample(np.concatenate([logits, _logits(5, 1)]), adv, advanced=True, num_logprobs=20).token_ids
    np.testing.assert_array_equal(np.asarray(advanced)[:size], basic)


@pytest.mark.parametrize("platform", ["cuda", "rocm", "cpu", "tpu"])
def test_basic_variant_has_no_host_synced_branch_on_gpu(platform: str):
    """XLA:GPU reads a conditional's predicate on the host, which then waits for the whole forward before it can
    launch the rest: the basic variant lowered for a GPU holds no data-dependent conditional or loop. CPU and TPU
    evaluate predicates on the device and keep the one that skips the draw of an all-greedy step."""
    st = build_sampling_tensors(_rows(4, temperature=0.5), 4, HIST, BIAS, False)
    basic = jax.jit(partial(sample, advanced=False, num_logprobs=20)).trace(_logits(0, 4), st)
    found = host_synced_control_flow(basic.lower(lowering_platforms=(platform,)))
    if platform in ("cuda", "rocm"):
        assert found == []
    else:  # (and their threefry lowering loops over its rounds: a loop on the device too)
        assert [f for f in found if "while" not in f] == ["stablehlo.case at jit(sample)/cond/branch_0_fun/cond"]
    # The checker sees the advanced variant's conditionals (penalties, draw, truncation, logprobs) on a GPU too.
    st = build_sampling_tensors(_rows(4, temperature=0.5), 4, HIST, BIAS, True)
    advanced = jax.jit(partial(sample, advanced=True, num_logprobs=20)).trace(_logits(0, 4), st)
    assert len(host_synced_control_flow(advanced.lower(lowering_platforms=(platform,)))) >= 4


# ---------------------------------------------------------------------------------------------- penalties and bias


def _penalty_rows(lg: np.ndarray) -> list[RowSampling]:
    top = [int(t) for t in np.argsort(-lg, axis=-1)[:, 0]]
    pos = [int(t) for t in np.nonzero(lg[0] > 0.5)[0][:3]]
    neg = [int(t) for t in np.nonzero(lg[0] < -0.5)[0][:3]]
    return [
        # repetition over prompt and output, on positive and negative logits, repeated ids counted once
        RowSampling(temperature=0.0, repetition_penalty=1.3, prompt_ids=pos + [neg[0], neg[0]], output_ids=neg[1:]),
        # presence: output tokens only; 3 is only in the prompt
        RowSampling(temperature=0.0, presence_penalty=0.6, prompt_ids=[3, 4], output_ids=[4, 4, 9]),
        # frequency scales with the output count; 1 is only in the prompt
        RowSampling(temperature=0.0, frequency_penalty=0.25, prompt_ids=[1, 1, 1], output_ids=[2, 2, 2, 8]),
        RowSampling(
            temperature=0.0,
            repetition_penalty=1.2,
            presence_penalty=0.3,
            frequency_penalty=0.1,
            prompt_ids=[10, 11, 12],
            output_ids=[12, 13, 13, 10],
            logit_bias={10: 2.5, 11: -float("inf"), 5: -1.0, 14: 4.0},
        ),  # fmt: skip
        RowSampling(temperature=0.0, logit_bias={top[4]: -float("inf")}),  # greedy moves to the runner-up
        RowSampling(temperature=0.0),  # nothing: unchanged
        RowSampling(temperature=0.0, repetition_penalty=0.8, prompt_ids=[20, 21, 22, 23], output_ids=[24, 25]),
        RowSampling(temperature=0.0, repetition_penalty=2.0, prompt_ids=[top[7]]),  # halves the best logit
    ]


def test_penalties_and_bias_match_numpy():
    lg = _logits(3, S8)
    rows = _penalty_rows(lg)
    st = build_sampling_tensors(rows, S8, HIST, BIAS, True)
    got = np.asarray(_process(lg, st))
    want = np.stack([ref_process(lg[i], r) for i, r in enumerate(rows)])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(got[5], lg[5])  # bit for bit
    assert got[1, 3] == lg[1, 3] and got[2, 1] == lg[2, 1]  # prompt-only tokens: no presence/frequency
    assert got[3, 11] == -np.inf
    # Greedy is the argmax of the processed logits, and the penalties did change some argmaxes.
    out = _sample(lg, st, advanced=True, num_logprobs=20)
    np.testing.assert_array_equal(np.asarray(out.token_ids), np.argmax(want, axis=-1))
    assert np.argmax(want[4]) != np.argmax(lg[4]) and np.argmax(want[7]) != np.argmax(lg[7])


def test_neg_inf_bias_forbids_tokens():
    """-inf bias (how min_tokens masks stop ids) holds even at a high temperature and on the likeliest tokens."""
    lg = _logits(4, S8, scale=4.0)
    forbidden = [set(np.argsort(-lg[i])[:4].tolist()) for i in range(S8)]
    seen = set()
    for counter in range(12):
        rows = [
            RowSampling(temperature=3.0, seed=i, counter=counter, logit_bias=dict.fromkeys(forbidden[i], -float("inf")))
            for i in range(S8)
        ]
        st = build_sampling_tensors(rows, S8, HIST, BIAS, True)
        tokens = np.asarray(_sample(lg, st, advanced=True, num_logprobs=20).token_ids)
        assert not any(t in forbidden[i] for i, t in enumerate(tokens.tolist()))
        seen.update(tokens.tolist())
    assert len(seen) > 20


# ---------------------------------------------------------------------------------------------- logprobs


@pytest.mark.parametrize("penalties", [False, True], ids=["plain", "penalties"])
def test_logprobs_are_raw(penalties: bool):
    lg = _logits(5, S8)
    rows = [
        RowSampling(temperature=t, top_k=k, seed=i, logprobs=True)
        for i, (t, k) in enumerate(zip([0, 1, 0.5, 2] * 2, [0, 3] * 4, strict=True))
    ]
    assert needs_advanced([RowSampling(logprobs=True)])  # logprobs are the advanced variant's
    top = int(np.argmax(lg[1]))
    if penalties:  # bias and penalties change the draw, never the logprobs
        rows[1].logit_bias = {top: -float("inf")}
        rows[2].repetition_penalty, rows[2].prompt_ids = 3.0, list(range(50))
    out = _sample(lg, build_sampling_tensors(rows, S8, HIST, BIAS, True), advanced=True, num_logprobs=20)
    want = np.asarray(jax.nn.log_softmax(lg, axis=-1))
    tokens = np.asarray(out.token_ids)
    np.testing.assert_allclose(np.asarray(out.logprobs), want[np.arange(S8), tokens], rtol=1e-6, atol=1e-6)
    order = np.argsort(-lg, axis=-1, kind="stable")[:, :20]
    np.testing.assert_array_equal(np.asarray(out.top_ids), order)
    np.testing.assert_allclose(np.asarray(out.top_logprobs), np.take_along_axis(want, order, -1), rtol=1e-6, atol=1e-6)
    if penalties:  # the forbidden token is still listed first, with its raw logprob, but was not drawn
        assert tokens[1] != top and out.top_ids[1, 0] == top


def test_logprob_output_shapes():
    st = build_sampling_tensors(_rows(3), 4, HIST, BIAS, False)
    lg = jax.ShapeDtypeStruct((4, 50), np.float32)
    for num, k in [(None, 0), (0, 0), (7, 7)]:
        out = jax.eval_shape(lambda x, s, n=num: sample(x, s, advanced=False, num_logprobs=n), lg, st)
        assert out.token_ids.shape == (4,) and out.logprobs.shape == (4,)
        assert out.top_ids.shape == out.top_logprobs.shape == (4, k)
    with pytest.raises(ValueError, match="num_logprobs"):
        jax.eval_shape(lambda x, s: sample(x, s, advanced=False, num_logprobs=51), lg, st)


# ---------------------------------------------------------------------------------------------- compilation


def test_compiles_once_per_variant():
    traces: list[bool] = []

    def counted(logits, st, *, advanced, num_logprobs):
        traces.append(advanced)
        return sample(logits, st, advanced=advanced, num_logprobs=num_logprobs)

    f = jax.jit(counted, static_argnames=("advanced", "num_logprobs"))
    lg = _logits(6, S8, vocab=300)
    mixes = [
        [RowSampling(temperature=0.0)] * 3,
        [RowSampling(temperature=0.7, min_p=0.1, seed=1), RowSampling(0.0)],
        _rows(S8, temperature=1.3),
    ]
    penalties = dict(repetition_penalty=1.2, frequency_penalty=0.5, prompt_ids=[1, 2], output_ids=[2, 2, 3])
    advanced_mixes = mixes + [
        [RowSampling(temperature=0.7, top_k=5, seed=1), RowSampling(top_p=0.5, min_p=0.1), RowSampling(0.0)],
        [RowSampling(temperature=1.0, top_k=290, top_p=0.99, seed=2**32 - 1, counter=17)] * S8,
        [RowSampling(temperature=0.0, logprobs=True)],
        [RowSampling(temperature=0.0, logit_bias={5: -float("inf")})],
        [RowSampling(temperature=0.9, seed=3, presence_penalty=0.3, output_ids=[7]), RowSampling(**penalties)],
    ]
    for advanced, ms in [(False, mixes), (True, advanced_mixes)]:
        for rows in ms:
            st = build_sampling_tensors(rows, S8, HIST, BIAS, advanced)
            jax.block_until_ready(f(lg, st, advanced=advanced, num_logprobs=5))
    assert traces == [False, True]
    if hasattr(f, "_cache_size"):
        assert f._cache_size() == 2


# ---------------------------------------------------------------------------------------------- host side


def test_build_pads_and_types():
    rows = [
        RowSampling(temperature=0.5, top_k=3, top_p=0.9, min_p=0.1, seed=2**32 - 1, counter=4),
        RowSampling(repetition_penalty=1.1, prompt_ids=[1, 2], output_ids=[3], logit_bias={9: -float("inf"), 4: 1.5}),
        RowSampling(logit_bias={7: 1.0}, prompt_ids=list(range(100))),  # no penalties: history never read or checked
    ]
    st = build_sampling_tensors(rows, 5, 16, 4, advanced=True)
    assert isinstance(st, SamplingTensors) and st.num_rows == 5
    assert st.history.shape == (5, 16) and st.bias_ids.shape == st.bias_values.shape == (5, 4)
    dtypes = {name: np.asarray(v).dtype for name, v in st.__dict__.items()}
    assert dtypes["seeds"] == np.uint32 and dtypes["counter"] == dtypes["top_k"] == dtypes["history"] == np.int32
    assert dtypes["temperature"] == dtypes["bias_values"] == np.float32
    assert st.seeds[0] == 2**32 - 1 and st.counter[0] == 4 and st.top_k[0] == 3
    np.testing.assert_array_equal(st.history[1, :4], [1, 2, 3, -1])
    assert st.prompt_lens[1] == 2 and (st.history[2] == -1).all()
    assert sorted(zip(st.bias_ids[1, :2].tolist(), st.bias_values[1, :2].tolist(), strict=True)) == [
        (4, 1.5),
        (9, -np.inf),
    ]
    assert (st.bias_ids[1, 2:] == -1).all()
    # Padding rows are greedy and truncate nothing.
    assert (st.temperature[3:] == 0).all() and (st.top_p[3:] == 1).all() and (st.repetition_penalty[3:] == 1).all()
    basic = build_sampling_tensors([RowSampling(temperature=0.5, min_p=0.1)], 4, 16, 4, advanced=False)
    assert basic.history.shape == basic.bias_ids.shape == (4, 1)


@pytest.mark.parametrize(
    "rows, num_rows, advanced, field",
    [
        ([RowSampling(logit_bias={i: 1.0 for i in range(5)})], 2, True, "logit_bias"),
        ([RowSampling(presence_penalty=0.1, prompt_ids=[1] * 10, output_ids=[2] * 7)], 2, True, "history_len"),
        ([RowSampling()] * 3, 2, False, "rows"),
        ([RowSampling(frequency_penalty=0.5)], 2, False, "advanced=True"),
        ([RowSampling(logit_bias={1: 1.0})], 2, False, "advanced=True"),
        ([RowSampling(top_p=0.9)], 2, False, "advanced=True"),
        ([RowSampling(logprobs=True)], 2, False, "advanced=True"),
        ([RowSampling(seed=2**32)], 2, False, "seed"),
        ([RowSampling(counter=-1)], 2, False, "counter"),
    ],
)
def test_build_rejects(rows, num_rows, advanced, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        build_sampling_tensors(rows, num_rows, 16, 4, advanced)


def test_needs_advanced():
    assert not needs_advanced([RowSampling(temperature=0.3, min_p=0.1, seed=9), RowSampling(temperature=0.0)])
    # A greedy row ignores top-k and top-p: it stays in the basic variant.
    assert not needs_advanced([RowSampling(temperature=0.0, top_k=5, top_p=0.5)])
    for extra in [
        dict(repetition_penalty=1.1), dict(presence_penalty=-0.5), dict(frequency_penalty=1.0), dict(top_k=5),
        dict(top_p=0.9), dict(logprobs=True),
    ]:  # fmt: skip
        assert needs_advanced([RowSampling(), RowSampling(**extra)])
    assert needs_advanced([RowSampling(logit_bias={3: -float("inf")})])


@pytest.mark.parametrize("vocab", [257, 49152])
def test_prompt_logprobs_of_bfloat16_logits_are_computed_in_float32(vocab):
    """A model of one's own may return bfloat16 logits: the log-softmax over them in bfloat16 was off by ~6e-2."""
    import jax.numpy as jnp

    logits = jnp.asarray(np.random.default_rng(vocab).normal(0, 4, (5, vocab)), jnp.bfloat16)
    ids = jnp.arange(5, dtype=jnp.int32) * 7
    lp, top_ids, top_lp = sampling.compute_logprobs(logits, ids, 3)
    want = jax.nn.log_softmax(np.asarray(logits, np.float32), axis=-1)  # the same values, upcast first
    np.testing.assert_allclose(lp, np.take_along_axis(np.asarray(want), np.asarray(ids)[:, None], -1)[:, 0], atol=1e-5)
    np.testing.assert_allclose(top_lp, np.take_along_axis(np.asarray(want), np.asarray(top_ids), -1), atol=1e-5)
    assert lp.dtype == jnp.float32


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("allowed", [(4,), (0, 6, 9), (2, 11, 3, 5)])
def test_only_biased_rows_sample_only_their_allowed_tokens(allowed, temperature):
    """allowed_token_ids (bias entries of 0 on an only_biased row): the draw follows the reference's distribution
    over the allowed tokens alone, greedy takes the best of them, a -inf entry among them stays out, and a row
    beside it without the flag is untouched."""
    n = 4000 if temperature else 4
    masked = np.full_like(LOGITS12, -np.inf)
    masked[list(allowed)] = LOGITS12[list(allowed)]
    rows = [RowSampling(seed=i, temperature=temperature, logit_bias=dict.fromkeys(allowed, 0.0), only_biased=True)
            for i in range(n)]  # fmt: skip
    got = _tokens(np.tile(LOGITS12, (n, 1)), rows)
    if temperature == 0:
        assert set(got) == {allowed[int(np.argmax(LOGITS12[list(allowed)]))]}
    else:
        probs = ref_probs(masked, temperature)
        counts = np.bincount(got, minlength=len(LOGITS12))
        assert set(np.flatnonzero(counts)) <= set(allowed)
        for t in allowed:  # 5 sigma of a binomial
            assert abs(counts[t] - n * probs[t]) <= 5 * np.sqrt(n * probs[t] * (1 - probs[t])) + 1, (t, counts, probs)
    if len(allowed) > 1:  # the best allowed token banned (min_tokens' -inf on a stop id): the next best
        best = allowed[int(np.argmax(LOGITS12[list(allowed)]))]
        bias = {**dict.fromkeys(allowed, 0.0), best: float("-inf")}
        banned = _tokens(np.tile(LOGITS12, (4, 1)), [replace(r, logit_bias=bias) for r in rows[:4]])
        assert best not in set(banned) and set(banned) <= set(allowed)
    plain = RowSampling(seed=0, temperature=temperature, logit_bias={1: -5.0})
    both = _tokens(np.tile(LOGITS12, (2, 1)), [rows[0], plain])
    assert both[1] == _tokens(LOGITS12[None], [plain])[0] and both[0] in allowed


def _bad_words_reference(output: list[int], words: tuple[tuple[int, ...], ...]) -> set[int]:
    """vLLM's bad words: a word's last token is banned where the output's last tokens are the rest of the word."""
    return {w[-1] for w in words if len(output) >= len(w) - 1 and tuple(output[len(output) - len(w) + 1 :]) == w[:-1]}


def test_bad_words_ban_the_token_that_would_complete_one():
    """Words of 1-16 tokens against outputs that end with their beginnings (or not, or only inside the prompt),
    with the placeholder the engine gives a token in flight resolved first; rows without words are untouched."""
    rng = np.random.default_rng(0)
    vocab, n = 64, 24
    long_word = tuple(range(30, 46))  # BAD_WORD_MAX_TOKENS tokens
    cases = [  # (prompt, output, words)
        ([1, 2], [5, 6, 7], ((7, 8), (6, 9), (3,), (5, 6, 7, 10), (6, 7, 11), (4, 7, 12))),
        ([5, 6], [7], ((5, 6, 7, 13), (6, 7, 14), (7, 15))),  # a prefix reaching into the prompt does not count
        ([1], [], ((20,), (1, 21))),  # nothing generated yet: only one-token words
        ([9], list(range(30, 45)), (long_word, long_word[1:], (44, 50), (43, 51))),
        ([2], [8, 8, 8], ()),
    ]
    rows = [RowSampling(prompt_ids=p, output_ids=o, bad_words=w) for p, o, w in cases]
    rows += [RowSampling(prompt_ids=[1], output_ids=[2, 3]) for _ in range(n - len(rows))]
    logits = rng.normal(0, 1, (n, vocab)).astype(np.float32)
    st = build_sampling_tensors(rows, n, HIST, BIAS, advanced=True)
    got = np.asarray(_process(logits, st))
    for i, r in enumerate(rows):
        banned = _bad_words_reference(list(r.output_ids), r.bad_words)
        assert set(np.flatnonzero(np.isneginf(got[i]))) == banned, (i, banned)
        keep = np.ones(vocab, bool)
        keep[list(banned)] = False
        np.testing.assert_array_equal(got[i][keep], logits[i][keep])
    assert _bad_words_reference([5, 6, 7], cases[0][2]) == {3, 8, 10, 11}  # the reference itself

    # The last output token still in flight (a placeholder, -(row + 2)): the device resolves it from the feed.
    from jaxinfer.engine.runner import placeholder, resolve_placeholders

    inflight = [RowSampling(prompt_ids=[1], output_ids=[5, 6, placeholder(0)], bad_words=((6, 7, 8), (6, 9, 10)))]
    st = build_sampling_tensors(inflight, 2, HIST, BIAS, advanced=True)
    st = replace(st, recent_output=resolve_placeholders(st.recent_output, np.asarray([7, 0], np.int32)))
    assert set(np.flatnonzero(np.isneginf(np.asarray(_process(logits[:2], st))[0]))) == {8}


@pytest.mark.parametrize(("rows", "vocab"), [(1, 17), (6, 257), (4, 49152)])
def test_target_ranks_count_the_tokens_ahead(rows, vocab):
    """A token's rank (prompt_logprobs' `rank`): 1 + the tokens more likely than it, the tokens tied with it counted
    as ahead (vLLM's ranks)."""
    import jax.numpy as jnp

    rng = np.random.default_rng(vocab)
    logits = np.round(rng.normal(0, 2, (rows, vocab)), 1).astype(np.float32)  # rounded: ties among them
    ids = rng.integers(0, vocab, rows).astype(np.int32)
    logits[0, (ids[0] + 1) % vocab] = logits[0, ids[0]]  # at least one tie with the token itself
    want = [
        int(np.sum(logits[r] > logits[r, ids[r]])) + int(np.sum(logits[r] == logits[r, ids[r]])) for r in range(rows)
    ]
    assert list(np.asarray(sampling.target_ranks(jnp.asarray(logits), jnp.asarray(ids)))) == want


def test_numpy_scalars_are_taken_as_the_numbers_they_hold():
    """Notebook code passes numpy scalars (`seed=rng.integers(...)`, a temperature read from an array); they were
    refused as "must be an integer ... got np.int64(5)". They become Python numbers, which the wire to the engine's
    process carries, and equal params of Python numbers."""
    from jaxinfer.engine.core_process import pack, params_from_wire, params_to_wire, unpack
    from jaxinfer.types import SamplingParams

    given = dict(n=np.int64(2), max_tokens=np.int32(8), temperature=np.float32(0.5), top_p=np.float64(0.75),
                 top_k=np.int16(5), seed=np.uint64(2**63 + 1), logprobs=np.int8(2), stop_token_ids=np.array([1, 2]),
                 logit_bias={np.int64(3): np.float32(2.0)})  # fmt: skip
    sp = SamplingParams(**given)
    want = SamplingParams(n=2, max_tokens=8, temperature=0.5, top_p=0.75, top_k=5, seed=2**63 + 1, logprobs=2,
                          stop_token_ids=[1, 2], logit_bias={3: 2.0})  # fmt: skip
    assert sp == want
    scalars = [k for k in given if k not in ("stop_token_ids", "logit_bias")]
    assert [type(getattr(sp, k)) for k in scalars] == [type(getattr(want, k)) for k in scalars]
    assert [type(t) for t in sp.stop_token_ids] == [int, int]
    assert params_from_wire(unpack(pack(params_to_wire(sp)))) == want
    with pytest.raises(ValueError, match="max_tokens must be an integer"):  # still a number of the wrong kind
        SamplingParams(max_tokens=np.float32(8))


def _bits_allowed(mask: np.ndarray, vocab: int) -> np.ndarray:
    """bool[V] of a token mask (i32[M], bit t % 32 of word t // 32), by numpy's own bit order; past 32 * M: kept."""
    bits = np.unpackbits(mask.astype("<i4").view(np.uint8), bitorder="little").astype(bool)
    return np.concatenate([bits, np.ones(max(0, vocab - bits.size), bool)])[:vocab]


@pytest.mark.parametrize(("vocab", "words"), [(12, 1), (1000, 32), (1000, 8), (49152, 1536)])
def test_token_masks_rule_out_every_token_whose_bit_is_clear(vocab, words):
    """A structured output's mask (SamplingTensors.token_mask) sets exactly the tokens whose bit is clear to -inf,
    in its row only; a mask narrower than the vocabulary (8 words of 1000 tokens) keeps the tokens past it."""
    rng = np.random.default_rng(vocab + words)
    logits = rng.normal(size=(3, vocab)).astype(np.float32)
    mask = rng.integers(-(2**31), 2**31, size=words, dtype=np.int64).astype(np.int32)
    mask[0] &= ~1  # token 0 out, token 1 in, whatever the draw
    mask[0] |= 2
    rows = [
        RowSampling(temperature=0.0, token_mask=mask),
        RowSampling(logit_bias={1: 0.5}),
        RowSampling(token_mask=np.full(words, -1, np.int32)),
    ]
    st = build_sampling_tensors(rows, 3, HIST, BIAS, True, words)
    got = np.asarray(_process(logits, st))
    allowed = _bits_allowed(mask, vocab)
    np.testing.assert_array_equal(got[0], np.where(allowed, logits[0], -np.inf))
    np.testing.assert_array_equal(got[1], ref_process(logits[1], rows[1]))
    np.testing.assert_array_equal(got[2], logits[2])
    greedy = np.asarray(_sample(logits, st, advanced=True, num_logprobs=None).token_ids)
    assert greedy[0] == int(np.argmax(np.where(allowed, logits[0], -np.inf)))


def test_a_masked_row_draws_from_the_allowed_tokens_alone():
    """The draw of a masked row follows the reference distribution over its allowed tokens; greedy takes the best."""
    allowed = [0, 3, 5, 10]
    mask = np.zeros(1, np.int32)
    mask[0] = sum(1 << t for t in allowed)
    n = 4000
    rows = [RowSampling(seed=i, temperature=1.0, token_mask=mask) for i in range(n)]
    st = build_sampling_tensors(rows, n, HIST, BIAS, True, 1)
    got = np.asarray(_sample(np.tile(LOGITS12, (n, 1)), st, advanced=True, num_logprobs=None).token_ids)
    masked = np.where(np.isin(np.arange(12), allowed), LOGITS12, -np.inf)
    assert_frequencies(got, ref_probs(masked, 1.0))
    greedy = [RowSampling(seed=0, temperature=0.0, token_mask=mask)]
    assert _tokens(LOGITS12[None], greedy)[0] == 5
    with pytest.raises(ValueError, match="token_mask: row 0 has shape"):
        build_sampling_tensors(greedy, 1, HIST, BIAS, True, 2)
