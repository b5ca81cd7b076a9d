"""fp32 logits of every family equal transformers', for prefill of a padded batch and for step-by-step decode."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jaxinfer.generate import generate_tokens, run_step
from jaxinfer.model.attention import init_contiguous_cache
from jaxinfer.weights import load_weights
from tests.model.hf_reference import FAMILIES, build

PROMPT_LENS = (1, 7, 13, 20)
TOL = 1e-4


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def pair(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    hf = build(request.param, d)
    cfg, params, _ = load_weights(d)
    return hf, cfg, params


def _prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(1)
    return [rng.integers(0, vocab, n).tolist() for n in PROMPT_LENS]


def _hf_logits(hf, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].numpy()


def test_prefill_batch_matches(pair):
    hf, cfg, params = pair
    prompts = _prompts(cfg.vocab_size)
    b, t = len(prompts), 32
    tokens = np.zeros((b, t), np.int32)
    lens = np.array([len(p) for p in prompts])
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    pos = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
    out, _ = run_step(params, cfg, tokens, pos, pos < lens[:, None], init_contiguous_cache(cfg, b, 64), all_logits=True)
    out = np.asarray(out)
    for i, p in enumerate(prompts):
        np.testing.assert_allclose(out[i, : len(p)], _hf_logits(hf, p), atol=TOL, rtol=0)


def test_step_by_step_decode_matches(pair):
    """Prefill a few tokens of each prompt, then feed the rest one token per step through the cache."""
    hf, cfg, params = pair
    prompts = [p for p in _prompts(cfg.vocab_size) if len(p) > 3]
    b, pre = len(prompts), 3
    cache = init_contiguous_cache(cfg, b, 32)
    tokens = np.array([p[:pre] for p in prompts], np.int32)
    pos = np.broadcast_to(np.arange(pre, dtype=np.int32), (b, pre))
    _, cache = run_step(params, cfg, tokens, pos, np.ones((b, pre), bool), cache)
    refs = [_hf_logits(hf, p) for p in prompts]
    for step in range(pre, max(len(p) for p in prompts)):
        alive = np.array([step < len(p) for p in prompts])
        tok = np.array([[p[step] if step < len(p) else 0] for p in prompts], np.int32)
        out, cache = run_step(params, cfg, tok, np.full((b, 1), step, np.int32), alive[:, None], cache)
        out = np.asarray(out)
        for i in np.flatnonzero(alive):
            np.testing.assert_allclose(out[i], refs[i][step], atol=TOL, rtol=0, err_msg=f"row {i} step {step}")


def test_greedy_generation_matches(pair):
    hf, cfg, params = pair
    prompts = _prompts(cfg.vocab_size)[1:3]
    ours = generate_tokens(params, cfg, prompts, 12)
    for p, o in zip(prompts, ours, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)[
                0, len(p) :
            ].tolist()
        assert o == ref
