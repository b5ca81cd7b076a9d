"""Overlap scheduling (step N+1 dispatched before step N's tokens reach the host) changes nothing a user sees."""

from __future__ import annotations

import random

import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.engine.config import CacheConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.model import init_params
from jaxinfer.model_files import smollm2_gguf
from jaxinfer.weights import load_model
from tests.tiny_model import SMOLLM2_SETTINGS


@pytest.fixture(scope="module")
def smol():
    return load_model(str(smollm2_gguf()))


def _mixed_workload(tok, seed: int = 0) -> tuple[list[list[int]], list[SamplingParams]]:
    """Greedy and seeded sampling, penalties and bias, stop ids, EOS, n > 1, logprobs, prompt logprobs and
    min_tokens, over prompts of 1 to ~300 tokens, some sharing a long prefix (prefix-cache hits)."""
    rng = random.Random(seed)
    shared = tok.encode("You are a helpful assistant. Answer briefly and precisely. " * 6)
    texts = ["The capital of France is", "def fib(n):", "Once upon a time", "1, 2, 3,", "Q: What is JAX?\nA:",
             "Les fleurs du jardin", "import numpy as np\n", "The quick brown fox"]  # fmt: skip
    prompts, params = [], []
    for i in range(14):
        ids = tok.encode(rng.choice(texts))
        if i % 4 == 0:
            ids = shared + ids
        elif i % 7 == 3:
            ids = ids * 12  # a long prompt, prefilled in several chunks
        elif i % 9 == 5:
            ids = ids[:1]
        kind = i % 7
        common = dict(max_tokens=rng.randint(1, 16), seed=1000 + i)
        if kind == 0:
            sp = SamplingParams(temperature=0.0, **common)
        elif kind == 1:
            sp = SamplingParams(temperature=0.9, top_p=0.9, top_k=40, logprobs=3, **common)
        elif kind == 2:
            sp = SamplingParams(temperature=0.7, repetition_penalty=1.3, presence_penalty=0.5, **common)
        elif kind == 3:
            sp = SamplingParams(temperature=1.0, n=2, frequency_penalty=0.4, logit_bias={28: -5.0}, **common)
        elif kind == 4:
            sp = SamplingParams(temperature=0.0, stop_token_ids=[13, 30], min_tokens=2, **common)
        elif kind == 5:
            sp = SamplingParams(temperature=0.0, prompt_logprobs=2, logprobs=1, **common)
        else:
            sp = SamplingParams(temperature=1.2, min_p=0.05, **common)
        prompts.append(ids)
        params.append(sp)
    return prompts, params


def _run(loaded, overlap: bool, cache: CacheConfig, prompts, params):
    eng = Engine(loaded.config, loaded.params, cache, loaded.tokenizer.eos_token_ids, seed=0, overlap=overlap)
    seqs = eng.generate(prompts, params)
    assert not eng.has_unfinished() and not eng.seqs and not eng.groups
    assert eng.allocator.num_free == eng.allocator.num_pages  # every page back, cached ones included
    return seqs, eng


@pytest.mark.parametrize(
    "cache",
    [
        # SMOLLM2_SETTINGS (test_llm's, the live server's), whose compiled steps are shared.
        CacheConfig(
            block_size=16,
            num_pages=SMOLLM2_SETTINGS["num_kv_tokens"] // 16,
            **{k: SMOLLM2_SETTINGS[k] for k in ("max_model_len", "max_num_seqs", "max_num_batched_tokens")},
        ),
        # A pool of 40 pages for 16 running sequences: requests are preempted and recomputed.
        CacheConfig(block_size=8, num_pages=40, max_model_len=320, max_num_seqs=16, max_num_batched_tokens=64),
    ],
    ids=["roomy", "preempting"],
)
def test_overlap_on_and_off_give_identical_outputs(smol, cache):
    prompts, params = _mixed_workload(smol.tokenizer)
    on, eng_on = _run(smol, True, cache, prompts, params)
    off, eng_off = _run(smol, False, cache, prompts, params)
    assert eng_on.num_generated_tokens == eng_off.num_generated_tokens
    for group_on, group_off in zip(on, off, strict=True):
        for a, b in zip(group_on, group_off, strict=True):
            assert a.output_token_ids == b.output_token_ids, a.request_id
            assert (a.finish_reason, a.stop_reason) == (b.finish_reason, b.stop_reason)
            assert all(t >= 0 for t in a.output_token_ids)  # no placeholder survives
            assert len(a.output_logprobs) == (len(a.output_token_ids) if a.params.logprobs is not None else 0)
            for la, lb in zip(a.output_logprobs, b.output_logprobs, strict=True):
                assert la.keys() == lb.keys()
                np.testing.assert_allclose(list(la.values()), list(lb.values()), rtol=1e-5, atol=1e-5)
            if a.params.prompt_logprobs is not None:  # one entry per prompt token, even after preemptions
                assert len(a.prompt_logprobs) == len(b.prompt_logprobs) == len(a.prompt_token_ids)
    finish = {s.finish_reason for g in on for s in g}
    assert {"stop", "length"} <= finish  # the workload ends sequences both ways
    if cache.num_pages == 40:
        assert sum(s.num_preemptions for g in on for s in g) > 0
    # The overlapped loop runs one extra step at most per drain of the queue, never fewer tokens.
    assert abs(eng_on.num_steps - eng_off.num_steps) <= 0.1 * eng_off.num_steps + 2


def test_a_sequence_that_ends_in_flight_wastes_one_slot_and_nothing_else(smol):
    """With overlap a sequence that samples its stop token at step N is already in step N+1: that step's token for
    it is dropped and its pages are freed as soon as the host reads the stop token."""
    tok = smol.tokenizer
    cache = CacheConfig(block_size=16, num_pages=64, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64)
    eng = Engine(smol.config, smol.params, cache, tok.eos_token_ids, seed=0, overlap=True)
    # Stop on the token greedy decoding picks third: the sequence ends at a known step.
    probe = eng.generate([tok.encode("Hello")], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))[0][0]
    third = probe.output_token_ids[2]
    sp = SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=[third], ignore_eos=True)
    rid = eng.add_request(tok.encode("Hello"), sp)
    req = eng.seqs[rid]
    updates = []
    while eng.has_unfinished():
        updates += eng.step()
        if req.finish_reason is not None:
            assert req.pages == []  # freed when the stop token was read, with step N+1 possibly still running
    expected = probe.output_token_ids[: probe.output_token_ids.index(third) + 1]
    assert req.output_token_ids == expected and req.stop_reason == third
    assert [t for u in updates for t in u.new_token_ids] == req.output_token_ids
    assert eng.allocator.num_free == eng.allocator.num_pages


def test_llm_stop_strings_and_text_identical_with_overlap(smol):
    prompts = ["The capital of France is", "Write a haiku about the sea.", "def add(a, b):", "1, 2, 3, 4,"]
    params = [SamplingParams(max_tokens=40, temperature=0.0, stop=[".", "\n"]),
              SamplingParams(max_tokens=30, temperature=0.8, seed=3, stop=["sea"]),
              SamplingParams(max_tokens=30, temperature=0.0, stop=["return"], include_stop_str_in_output=True),
              SamplingParams(max_tokens=25, temperature=0.0, n=2, seed=5)]  # fmt: skip
    texts = {}
    for overlap in (True, False):
        # The "roomy" shapes above (and test_llm's): the compiled steps are reused.
        with LLM(str(smollm2_gguf()), **SMOLLM2_SETTINGS, overlap_scheduling=overlap) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False)
            texts[overlap] = [[(c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs]
            assert llm.engine.allocator.num_free == llm.engine.allocator.num_pages
    assert texts[True] == texts[False]
    assert any(c[3] is not None for o in texts[True] for c in o)  # some output did stop on a string


def test_tiny_random_workload_with_aborts_returns_every_page():
    from jaxinfer.config import ModelConfig

    cfg = ModelConfig(arch="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8, max_position_embeddings=256)  # fmt: skip
    params = init_params(cfg, seed=0, std=0.5)
    cache = CacheConfig(block_size=4, num_pages=40, max_model_len=64, max_num_seqs=8, max_num_batched_tokens=32)
    results = {}
    for overlap in (True, False):
        eng = Engine(cfg, params, cache, eos_token_ids=(0, 1), seed=0, overlap=overlap)
        rng = np.random.default_rng(1)
        aborted, kept = set(), {}
        for i in range(300):
            sp = SamplingParams(max_tokens=int(rng.integers(1, 16)), temperature=float(rng.choice([0.0, 1.0])),
                                n=int(rng.choice([1, 1, 2])), seed=i)  # fmt: skip
            rid = eng.add_request(rng.integers(2, 64, int(rng.integers(1, 24))).tolist(), sp)
            kept[rid] = [eng.seqs[s] for s in eng.groups[rid]]
            if i % 10 == 9:  # abort one at a fixed point of the schedule, in flight or not
                victim = f"req-{i - 5}"
                eng.abort(victim)
                aborted.add(victim)
            if i % 3 == 0:
                eng.step()
        while eng.has_unfinished():
            eng.step()
        assert eng.allocator.num_free == eng.allocator.num_pages
        assert not eng.seqs and not eng.groups
        results[overlap] = {rid: [s.output_token_ids for s in seqs] for rid, seqs in kept.items() if rid not in aborted}
    # Requests never aborted end the same; with aborts the loops differ only in what a victim had produced.
    assert results[True] == results[False]
