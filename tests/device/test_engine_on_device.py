"""The engine end to end on the device: bf16 greedy tokens against the CPU float32 run of the same model, seeded
batch invariance, and no compiles after warm-up."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest

from jaxinfer.engine.config import CacheConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.runner import compile_count, paged_step
from jaxinfer.engine.transfer import to_flat
from jaxinfer.generate import generate_tokens
from jaxinfer.model_files import smollm2_gguf
from jaxinfer.types import SamplingParams
from jaxinfer.weights import load_weights

NEW = 16
CC = CacheConfig(block_size=16, max_model_len=512, max_num_seqs=8, max_num_batched_tokens=128)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(3, 40000, n).tolist() for n in (5, 17, 40, 64, 130, 9, 250, 33)]


@pytest.fixture(scope="module")
def engine():
    cfg, params, _ = load_weights(smollm2_gguf())  # dtype auto: bfloat16 on a GPU/TPU
    assert cfg.dtype == "bfloat16"
    eng = Engine(cfg, params, CC)
    eng.runner.warmup()
    return eng


def test_bf16_greedy_tokens_agree_with_cpu_fp32(engine, prompts):
    """Agreement rule: at least 3 in 4 prompts agree on their first 4 greedy tokens, and the common prefix of the 16
    tokens averages at least 8 over the prompts. bf16 rounding flips near-ties (random-token prompts have many), after
    which greedy runs differ; a CPU bf16 run of this test gave prefixes [16, 7, 16, 16, 1, 16, 16, 16]."""
    greedy = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    got = [o[0].output_token_ids for o in engine.generate(prompts, greedy)]
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        cfg32, params32, _ = load_weights(smollm2_gguf(), dtype="float32")
        params32 = jax.device_put(params32, cpu)
        want = generate_tokens(params32, cfg32, prompts, NEW)
    pairs = zip(got, want, strict=True)
    prefix = [next((i for i, (a, b) in enumerate(zip(g, w, strict=True)) if a != b), NEW) for g, w in pairs]
    assert sum(p >= 4 for p in prefix) >= 0.75 * len(prefix), (prefix, got, want)
    assert np.mean(prefix) >= 8, (prefix, got, want)


def test_seeded_request_is_batch_invariant(engine, prompts):
    params = SamplingParams(max_tokens=NEW, temperature=0.8, top_p=0.95, seed=1234, ignore_eos=True)
    alone = engine.generate([prompts[2]], params)[0][0].output_token_ids
    others = SamplingParams(max_tokens=NEW, temperature=1.0, seed=7, ignore_eos=True)
    batch = engine.generate([prompts[0], prompts[2], *prompts[3:]], [others, params, *[others] * 5])
    assert batch[1][0].output_token_ids == alone


def test_no_compiles_after_warmup(engine, prompts):
    before = compile_count()
    engine.generate(prompts, SamplingParams(max_tokens=NEW, temperature=0.7, seed=3, ignore_eos=True))
    engine.generate(prompts[:3], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert compile_count() == before


def compiled_plain_step(engine, decode_only: bool) -> str:
    """The optimized HLO of the engine's step for plain requests (the sampler's basic variant), compiled for this
    device as the engine compiles it."""
    r, cc = engine.runner, engine.runner.cc
    t = cc.max_num_seqs if decode_only else cc.max_num_batched_tokens
    flat, layout = to_flat(r.padding_inputs(False, t, cc.max_num_seqs))
    static = r.step_static(layout, decode_only, advanced=False, prompt_lp=False)
    return paged_step.lower(**static, **r._dynamic(flat)).compile().as_text()


@pytest.mark.parametrize("decode_only", [True, False], ids=["decode", "mixed"])
def test_plain_step_holds_no_host_synced_branch_on_gpu(engine, decode_only):
    """XLA:GPU copies a conditional's (or loop's) predicate to the host and waits for it behind the whole forward;
    the step of greedy/temperature/min-p requests must hold none after XLA's own passes. (TPUs evaluate predicates
    on the device: their step keeps the conditional that skips an all-greedy step's draw.)"""
    if jax.default_backend() != "gpu":
        pytest.skip("only XLA:GPU reads predicates on the host")
    found = re.findall(r"[\s)}](conditional|while)\(", compiled_plain_step(engine, decode_only))
    assert found == [], found
