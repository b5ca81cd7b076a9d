"""LLM.beam_search (vLLM's) against a plain beam search written here over the tiny random-weight model's logits from the
contiguous (non-paged) forward pass: the same beams, scores and texts, EOS ending a beam, and length_penalty; beam
width 1 is greedy decoding."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxinfer import LLM, BeamSearchParams, SamplingParams
from tests.tiny_model import SETTINGS, write_tiny_model

PROMPTS = ["The capital of France is", "def add(a, b):"]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-beams") / "ck"
    write_tiny_model(path)
    # A float32 pool: the reference's logprobs are the float32 forward pass's, so ranks agree to ~1e-6.
    with LLM(str(path), **SETTINGS, kv_cache_dtype="float32") as llm:
        yield llm


def _logprobs(llm: LLM, tokens: list[int]) -> np.ndarray:
    """log-softmax over the whole vocabulary of the next token after `tokens`, on the contiguous path."""
    from jaxinfer.generate import run_step
    from jaxinfer.model.attention import init_contiguous_cache

    runner = llm.engine.runner
    t = len(tokens)
    pos = np.arange(t, dtype=np.int32)[None]
    lg, _ = run_step(runner.family_params(), runner.cfg, np.asarray([tokens], np.int32), pos, pos < t,
                     init_contiguous_cache(runner.cfg, 1, t), all_logits=True)  # fmt: skip
    return np.asarray(jax.nn.log_softmax(lg[0, t - 1].astype(np.float32)), np.float64)


def _reference(llm: LLM, prompt: list[int], width: int, steps: int, eos: set[int], length_penalty: float):
    """vLLM's (and Hugging Face's) beam search: each beam extended by its 2 * width most likely tokens (of the whole
    vocabulary's log-softmax); extensions ending in EOS complete, the `width` best others go on."""

    def score(tokens, cum):
        return cum / ((len(tokens) - (tokens[-1] in eos)) ** length_penalty)

    beams, done = [(list(prompt), 0.0)], []
    for _ in range(steps):
        extended = []
        for tokens, cum in beams:
            lp = _logprobs(llm, tokens)
            for tok in np.argsort(-lp, kind="stable")[: 2 * width]:
                (done if tok in eos else extended).append((tokens + [int(tok)], cum + lp[tok]))
        extended.sort(key=lambda b: score(*b), reverse=True)
        beams = extended[:width]
    return sorted(done + beams, key=lambda b: score(*b), reverse=True)[:width]


@pytest.mark.parametrize(("width", "length_penalty"), [(1, 1.0), (3, 1.0), (2, 0.0)])
def test_beams_equal_the_reference_search(llm, width, length_penalty):
    steps = 4
    params = BeamSearchParams(beam_width=width, max_tokens=steps, ignore_eos=True, length_penalty=length_penalty)
    outs = llm.beam_search(PROMPTS, params)
    assert len(outs) == len(PROMPTS)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids = llm.tokenizer.encode(prompt)
        want = _reference(llm, ids, width, steps, set(), length_penalty)
        assert [s.tokens for s in out.sequences] == [t for t, _ in want]
        for seq, (_, cum) in zip(out.sequences, want, strict=True):
            assert seq.cum_logprob == pytest.approx(cum, abs=1e-4)
            assert seq.text == llm.tokenizer.decode(seq.tokens[len(ids) :], skip_special_tokens=True)
            assert seq.finish_reason == "length" and len(seq.logprobs) == steps
            assert all(tok in alts for tok, alts in zip(seq.tokens[len(ids) :], seq.logprobs, strict=True))
    if width == 1:  # greedy decoding
        greedy = llm.generate(PROMPTS, SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True), use_tqdm=False)
        assert [o.sequences[0].tokens[-steps:] for o in outs] == [g.outputs[0].token_ids for g in greedy]


def test_eos_completes_a_beam(llm, monkeypatch):
    """A beam whose next token is EOS completes there (finish_reason "stop") and is ranked with the others by its
    score, which length_penalty weighs against the longer beams; with ignore_eos it goes on."""
    ids = llm.tokenizer.encode(PROMPTS[0])
    lp = _logprobs(llm, ids)
    eos = int(np.argmax(lp))  # the most likely first token plays EOS: the best beam ends at once
    monkeypatch.setattr(llm.engine, "eos_token_ids", (eos,))
    ranked: dict[float, list] = {}
    for penalty in (0.0, 1.0, 8.0):
        out = llm.beam_search(PROMPTS[0], BeamSearchParams(beam_width=2, max_tokens=3, length_penalty=penalty))[0]
        want = _reference(llm, ids, 2, 3, {eos}, penalty)
        assert [s.tokens for s in out.sequences] == [t for t, _ in want]
        stopped = [s for s in out.sequences if s.finish_reason == "stop"]
        assert all(s.tokens[-1] == eos and len(s.tokens) == len(ids) + 1 for s in stopped)
        ranked[penalty] = stopped
    # By cumulative logprob alone the one-token beam wins; a steep length_penalty favours the longer ones.
    assert ranked[0.0] and not ranked[8.0]
    went_on = llm.beam_search(PROMPTS[0], BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True))[0]
    assert [s.tokens for s in went_on.sequences] == [t for t, _ in _reference(llm, ids, 2, 3, set(), 1.0)]
    assert all(len(s.tokens) == len(ids) + 3 and s.finish_reason == "length" for s in went_on.sequences)


def test_bad_params_name_the_parameter(llm):
    with pytest.raises(ValueError, match="beam_width must be an integer >= 1"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 1"):
        BeamSearchParams(beam_width=2, max_tokens=0)
    with pytest.raises(ValueError, match="length_penalty must be a finite number"):
        BeamSearchParams(beam_width=2, max_tokens=2, length_penalty=float("nan"))
    with pytest.raises(ValueError, match=r"beam_width: at most 10 with max_logprobs=20"):
        llm.beam_search("x", BeamSearchParams(beam_width=11, max_tokens=2))
    with pytest.raises(ValueError, match="params: expected a BeamSearchParams"):
        llm.beam_search("x", SamplingParams())
    # The engine is left as it was: nothing queued, every page free.
    assert not llm.engine.has_unfinished()


def test_a_beam_that_fills_the_context_ends_there(llm):
    context = llm.engine.cc.max_model_len
    prompt = list(range(100, 100 + context - 2))
    out = llm.beam_search({"prompt_token_ids": prompt}, BeamSearchParams(beam_width=2, max_tokens=5))[0]
    assert len(out.sequences) == 2
    assert all(len(s.tokens) == context and s.finish_reason == "length" for s in out.sequences)
