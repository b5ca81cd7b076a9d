"""The offline LLM API on the PyPI models: batching never changes results, sampling knobs are honoured."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random

import jax
import numpy as np
import pytest
from tqdm.auto import tqdm

from jaxinfer import LLM, SamplingParams
from jaxinfer.engine.async_engine import AsyncEngine
from jaxinfer.engine.config import CacheConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.output import OutputAccumulator
from jaxinfer.host_memory import release_freed_memory
from jaxinfer.model import init_params
from jaxinfer.model_files import gemma3_270m_gguf, smollm2_gguf
from jaxinfer.types import with_bad_words_ids
from tests.tiny_model import SMOLLM2_SETTINGS

TEXTS = [
    "The capital of France is",
    "def add(a, b):",
    "Once upon a time",
    "1, 2, 3, 4,",
    "Les fleurs du jardin sont",
    "日本の首都は",
    "Q: Why is the sky blue?\nA:",
    "import numpy as np\n",
]


# test_paged_engine.py's Gemma 3 engine (test_paged_equals_contiguous[gemma3-8-32-8]): its compiled steps.
GEMMA_SETTINGS = dict(block_size=8, num_kv_tokens=512, max_model_len=128, max_num_seqs=8, max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def smol():
    with LLM(str(smollm2_gguf()), **SMOLLM2_SETTINGS) as llm:
        yield llm


# Gemma 3 (262k vocabulary: a costly LM head) takes half the requests. Both run 4-8 times as many requests as rows,
# with settings other tests use too: the compiled steps (~2 s each on the CI machine class) are shared.
@pytest.mark.parametrize("which, num_requests", [("smollm2", 64), ("gemma3", 32)])
def test_batched_greedy_equals_alone(which, num_requests):
    """Mixed requests in one generate(), more than fit at once, give the same tokens as each request alone (every
    fourth request is run alone: all of them alone were most of this test's time on the CI machine class)."""
    path, settings = (smollm2_gguf(), SMOLLM2_SETTINGS) if which == "smollm2" else (gemma3_270m_gguf(), GEMMA_SETTINGS)
    rng = random.Random(0)
    prompts = [" ".join(rng.sample(TEXTS, 2))[: rng.randint(5, 60)] for _ in range(num_requests)]
    lens = [rng.randint(1, 6 if which == "smollm2" else 3) for _ in prompts]
    params = [SamplingParams(max_tokens=n, temperature=0.0) for n in lens]
    with LLM(str(path), **settings) as llm:
        together = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        picked = range(0, len(prompts), 4)
        alone = [llm.generate(prompts[i], params[i], use_tqdm=False)[0].outputs[0].token_ids for i in picked]
        assert [together[i] for i in picked] == alone
        assert llm.engine.allocator.num_free == llm.engine.allocator.num_pages


def test_seeded_sampling_ignores_batch(smol):
    sp = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, top_k=50, seed=1234)
    alone = smol.generate(TEXTS[0], sp, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(max_tokens=10, temperature=0.7, seed=i) for i in range(7)]
    mixed = smol.generate(TEXTS[1:] + [TEXTS[0]], others + [sp], use_tqdm=False)[-1].outputs[0].token_ids
    first = smol.generate([TEXTS[0]] + TEXTS[3:5], [sp] + others[:2], use_tqdm=False)[0].outputs[0].token_ids
    assert alone == mixed == first


def _logprob_bits(out) -> list:
    """Each sampled token with its top logprobs, as the floats' bits."""
    c = out.outputs[0]
    return [
        (t, sorted((i, np.float32(v).tobytes()) for i, v in d.items()))
        for t, d in zip(c.token_ids, c.logprobs, strict=True)
    ]


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's batch-invariant forms")
def test_logprobs_are_bit_identical_alone_and_batched(smol):
    """Batch invariance on CPU, beyond the sampled tokens: every logprob of a seeded request is the same float alone
    (one-row decode steps), beside four others (the 8-row bucket) and among eleven (more than the 8 rows a step
    holds, so its steps also mix with prompt chunks). jaxinfer.model.layers.project and rms_norm give it."""
    sp = SamplingParams(max_tokens=12, temperature=1.0, seed=7, logprobs=3)
    prompts = TEXTS[:3]
    alone = [_logprob_bits(smol.generate(p, sp, use_tqdm=False)[0]) for p in prompts]
    for n in (5, 11):
        batch = [TEXTS[i % len(TEXTS)] + " " * (i // len(TEXTS)) for i in range(n)]
        outs = smol.generate(batch, [sp] * n, use_tqdm=False)
        assert [_logprob_bits(o) for o in outs[:3]] == alone, f"batch of {n}"


def test_reset_prefix_cache_makes_the_next_generate_compute_its_prompt(smol):
    """LLM.reset_prefix_cache (vLLM's): a repeated prompt's pages come from the prefix cache, and after the reset
    they are computed again, giving the same tokens."""
    prompt, sp = TEXTS[6] * 8, SamplingParams(max_tokens=3, temperature=0.0)
    first = smol.generate(prompt, sp, use_tqdm=False)[0]
    again = smol.generate(prompt, sp, use_tqdm=False)[0]
    smol.reset_prefix_cache()
    reset = smol.generate(prompt, sp, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0 and reset.num_cached_tokens == 0
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == reset.outputs[0].token_ids


def test_n_samples_share_the_prompt(smol):
    sp = SamplingParams(n=4, max_tokens=8, temperature=1.0, seed=7)
    out = smol.generate(TEXTS[6] * 6, sp, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # different seeds per sample
    # Samples 1..3 reused the prompt pages computed by sample 0.
    assert smol.engine.allocator.hit_tokens >= 3 * (len(out.prompt_token_ids) // 16) * 16
    again = smol.generate(TEXTS[6] * 6, sp, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def test_samples_of_neighbouring_seeds_are_not_shared(smol):
    """Sample i of seed s used to be seed s + i (vLLM's rule): samples 1..3 of seed 0 were samples 0..2 of seed 1,
    so a sweep over seeds with n > 1 drew the same samples again. Sample 0 keeps the seed (as with n = 1)."""
    from jaxinfer.engine.engine import sample_seed

    def samples(seed: int) -> list[tuple[int, ...]]:
        sp = SamplingParams(n=4, max_tokens=6, temperature=1.0, seed=seed, ignore_eos=True)
        return [tuple(c.token_ids) for c in smol.generate(TEXTS[1], sp, use_tqdm=False)[0].outputs]

    a, b = samples(0), samples(1)
    assert not set(a) & set(b), (a, b)
    single = SamplingParams(n=1, max_tokens=6, temperature=1.0, seed=1, ignore_eos=True)
    assert smol.generate(TEXTS[1], single, use_tqdm=False)[0].outputs[0].token_ids == list(b[0])
    seeds = {sample_seed(s, i) for s in range(64) for i in range(16)}
    assert len(seeds) == 64 * 16 and all(0 <= x < 2**32 for x in seeds)


def test_stop_string_spanning_tokens(smol):
    base = smol.generate(TEXTS[0], SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)[0].outputs[0]
    text = base.text
    assert len(text) > 8
    stop = text[3:9]  # spans token boundaries
    out = smol.generate(TEXTS[0], SamplingParams(max_tokens=12, temperature=0.0, stop=[stop]), use_tqdm=False)
    c = out[0].outputs[0]
    assert c.text == text[:3] and c.finish_reason == "stop" and c.stop_reason == stop
    inc = SamplingParams(max_tokens=12, temperature=0.0, stop=[stop], include_stop_str_in_output=True)
    assert smol.generate(TEXTS[0], inc, use_tqdm=False)[0].outputs[0].text == text[:9]


def test_multibyte_text_streams_whole_characters(smol):
    out = smol.generate(TEXTS[5], SamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False)[0].outputs[0]
    # Mid-text characters are never broken; only a character cut by max_tokens can end the text unfinished.
    assert "\ufffd" not in out.text[:-1]
    assert out.text == smol.tokenizer.decode(out.token_ids)


def test_stop_token_ids_min_tokens_ignore_eos_and_logprobs(smol):
    base = smol.generate(TEXTS[0], SamplingParams(max_tokens=10, temperature=0.0), use_tqdm=False)[0].outputs[0]
    stop_id = base.token_ids[3]
    c = smol.generate(TEXTS[0], SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[stop_id]),
                      use_tqdm=False)[0].outputs[0]  # fmt: skip
    assert c.token_ids == base.token_ids[: base.token_ids.index(stop_id) + 1] and c.stop_reason == stop_id
    eos = smol.tokenizer.eos_token_ids[0]
    forced = SamplingParams(max_tokens=6, temperature=0.0, min_tokens=6, logit_bias={eos: 100.0})
    c = smol.generate(TEXTS[0], forced, use_tqdm=False)[0].outputs[0]
    assert len(c.token_ids) == 6 and eos not in c.token_ids  # min_tokens outranks a +100 bias on EOS
    c = smol.generate(TEXTS[0], SamplingParams(max_tokens=3, temperature=0.0, logit_bias={eos: 100.0},
                                               ignore_eos=True), use_tqdm=False)[0].outputs[0]  # fmt: skip
    assert c.token_ids == [eos] * 3 and c.finish_reason == "length"
    c = smol.generate(TEXTS[0], SamplingParams(max_tokens=4, temperature=0.0, logprobs=3), use_tqdm=False)[0].outputs[0]
    assert len(c.logprobs) == 4
    for tok, lp in zip(c.token_ids, c.logprobs, strict=False):
        assert tok in lp and len(lp) == 3 and max(lp.values()) == lp[tok]  # greedy token is the top-1
    assert c.cumulative_logprob == pytest.approx(sum(lp[t] for t, lp in zip(c.token_ids, c.logprobs, strict=False)))


def test_penalties_change_greedy_output(smol):
    prompt = "1, 2, 1, 2, 1, 2, 1, 2,"
    plain = smol.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)[0].outputs[0]
    pen = SamplingParams(max_tokens=8, temperature=0.0, repetition_penalty=2.0, frequency_penalty=1.5)
    c = smol.generate(prompt, pen, use_tqdm=False)[0].outputs[0]
    assert c.token_ids != plain.token_ids


@pytest.mark.parametrize(
    "kwargs, field",
    [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"n": 0}, "n"), ({"max_tokens": 0}, "max_tokens"),
     ({"top_k": -2}, "top_k"), ({"logprobs": -1}, "logprobs"), ({"stop": [""]}, "stop"), ({"min_p": 2}, "min_p"),
     ({"ignore_eos": "no"}, "ignore_eos"), ({"skip_special_tokens": None}, "skip_special_tokens"),
     ({"include_stop_str_in_output": 1}, "include_stop_str_in_output"), ({"stop": 5}, "stop"),
     ({"stop_token_ids": 5}, "stop_token_ids")],
)  # fmt: skip
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs, field",
    [({"max_num_seqs": 0}, "max_num_seqs"), ({"max_model_len": 0}, "max_model_len"),
     ({"enable_prefix_caching": "no"}, "enable_prefix_caching"), ({"max_logprobs": -1}, "max_logprobs"),
     ({"num_kv_tokens": 1.5}, "num_kv_tokens"), ({"seed": "7"}, "seed"), ({"tensor_parallel_size": 0}, "tensor"),
     ({"gpu_memory_utilization": "0.9"}, "gpu_memory_utilization"), ({"session_ttl": None}, "session_ttl"),
     # parsed only once the weights had loaded (1.3 s, and a notebook's traceback then held them)
     ({"kv_cache_memory": "lots"}, "kv_cache_memory"), ({"host_kv_cache_memory": "1 parsec"}, "host_kv_cache_memory")],
)  # fmt: skip
def test_bad_engine_settings_fail_at_construction(kwargs, field):
    """Once fell back to the default (`x or default`), passed as truthy, or built an engine that failed every
    request (max_logprobs=-1)."""
    from jaxinfer.engine.config import EngineArgs

    with pytest.raises(ValueError, match=field):
        EngineArgs(**kwargs)


@pytest.mark.parametrize("kwargs, error", [({"not_a_setting": 1}, TypeError), ({"max_num_seqs": 0}, ValueError)])
def test_a_failed_construction_raises_its_error_alone(kwargs, error, monkeypatch):
    """An LLM whose __init__ failed before it had an engine then printed "Exception ignored in LLM.__del__:
    AttributeError: 'LLM' object has no attribute 'engine'" after the real error."""
    import gc
    import sys

    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    with pytest.raises(error):
        LLM(**kwargs)
    gc.collect()
    assert not unraisable, [(u.exc_type, u.exc_value) for u in unraisable]


def test_a_context_past_the_models_is_refused_before_the_weights_load(monkeypatch):
    """max_model_len was checked against the model's context only after its weights had loaded (a notebook's
    traceback then held them)."""
    import jaxinfer.engine.build as build

    def no_loading(*args, **kwargs):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(build, "_load", no_loading)
    with pytest.raises(ValueError, match="max_model_len: 100000 exceeds the model's context length"):
        LLM(max_model_len=100_000)


BAD_CALLS = [
    ("generate", ({"prompt_token_ids": "123"},), "prompt_token_ids must be a list of integers"),
    ("generate", ({"prompt_token_ids": [1.7, 2]},), "prompt_token_ids must be a list of integers"),
    ("generate", ([[True, 2, 3]],), "prompt_token_ids must be a list of integers"),
    ("generate", ({"prompt": "Hi", "multi_modal_data": {}},), "unsupported key"),
    ("generate", (None,), "prompts: expected"),
    ("generate", (5,), "prompts: expected"),
    ("generate", ([[]],), "prompts: an empty prompt"),  # it said "expected text, ..., got list"
    ("generate", ("Hi", {"max_tokens": 4}), "sampling_params: expected"),
    ("chat", ([],), "messages: expected"),
    ("chat", ("Hello",), "messages: expected"),
    ("chat", ([{"role": "user"}],), r"messages\[0\].content"),
    ("chat", ([{"content": "hi"}],), r"messages\[0\]: a message"),
    ("chat", ([[{"role": "user", "content": "hi"}], []],), r"messages\[1\]: expected a non-empty list"),
]


@pytest.mark.parametrize("method, args, message", BAD_CALLS, ids=[m for _, _, m in BAD_CALLS])
def test_bad_prompts_and_conversations_name_the_problem(smol, method, args, message):
    """vLLM's inputs, each wrong in a way that was coerced (a string of digits, floats, bools), dropped (an unknown
    key, an empty conversation) or failed deep inside (a TypeError, a template's UndefinedError)."""
    with pytest.raises(ValueError, match=message):
        getattr(smol, method)(*args)
    assert not smol.engine.seqs and smol.engine.allocator.num_free == smol.engine.allocator.num_pages


def test_token_arrays_generators_and_content_parts(smol):
    g = SamplingParams(max_tokens=3, temperature=0.0)
    ids = smol.tokenizer.encode(TEXTS[0])
    want = smol.generate({"prompt_token_ids": ids}, g, use_tqdm=False)[0].outputs[0].token_ids
    assert smol.generate(np.array(ids), g, use_tqdm=False)[0].outputs[0].token_ids == want
    assert [o.outputs[0].token_ids for o in smol.generate((p for p in [ids, ids]), g, use_tqdm=False)] == [want] * 2
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    plain = [{"role": "user", "content": "Hi"}]
    texts = [smol.chat(msgs, g, use_tqdm=False)[0].outputs[0].text for msgs in (parts, plain)]
    assert texts[0] == texts[1]
    # "developer" is the system role, as the server renders it (SmolLM2's template would otherwise add its own
    # default system prompt after an unknown role).
    prompts = [smol.chat([{"role": role, "content": "Be brief."}, *plain], g, use_tqdm=False)[0].prompt_token_ids
               for role in ("developer", "system")]  # fmt: skip
    assert prompts[0] == prompts[1] and smol.tokenizer.decode(prompts[0], False).count("<|im_start|>system") == 1
    made = []

    def bar(**kwargs):  # use_tqdm as vLLM also takes it: a progress-bar factory
        made.append(kwargs)
        return tqdm(**{**kwargs, "disable": True})

    smol.generate(TEXTS[0], g, use_tqdm=bar)
    assert made and made[0]["total"] == 1


def test_chat_continues_the_final_message(smol):
    """continue_final_message (vLLM's): the prompt ends inside the assistant's begun answer, so the model goes on
    with it; given through chat_template_kwargs it wins over the arguments, as in vLLM."""
    g = SamplingParams(max_tokens=4, temperature=0.0)
    begun = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "The answer is"}]
    want = smol.tokenizer.apply_chat_template(begun[:1]) + "The answer is"
    out = smol.chat(begun, g, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)[0]
    assert out.prompt == want and out.prompt_token_ids == smol.tokenizer.encode(want, add_special_tokens=False)
    assert out.outputs[0].token_ids == smol.generate(want, g, use_tqdm=False)[0].outputs[0].token_ids
    kw = {"add_generation_prompt": False, "continue_final_message": True}
    assert smol.chat(begun, g, use_tqdm=False, chat_template_kwargs=kw)[0].prompt == want
    with pytest.raises(ValueError, match="add_generation_prompt=False"):
        smol.chat(begun, g, use_tqdm=False, continue_final_message=True)


def test_bad_requests_leave_nothing_behind(smol):
    with pytest.raises(ValueError, match="prompt: .* tokens leave no room"):
        smol.generate(["ok", "x " * 600], [SamplingParams(max_tokens=4), SamplingParams(max_tokens=4)])
    with pytest.raises(ValueError, match="prompt_logprobs"):
        smol.generate("hi", SamplingParams(prompt_logprobs=21))
    assert not smol.engine.has_unfinished()
    assert smol.engine.allocator.num_free == smol.engine.allocator.num_pages


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_generate_stops_at_the_context_and_leaves_nothing_when_it_fails_early(smol):
    # As vLLM's offline LLM: a max_tokens past the context ends at the context ("length"), not an error.
    for min_tokens in (0, 20):  # min_tokens past the context too
        sp = SamplingParams(max_tokens=100, min_tokens=min_tokens, ignore_eos=True)
        out = smol.generate([[1] * 500], sp, use_tqdm=False)[0].outputs[0]
        assert (len(out.token_ids), out.finish_reason) == (512 - 500, "length")

    def broken_bar(**kwargs):
        raise ZeroDivisionError  # a progress-bar factory that fails: the queued requests must not stay behind

    with pytest.raises(ZeroDivisionError):
        smol.generate(TEXTS, SamplingParams(max_tokens=50), use_tqdm=broken_bar)
    assert not smol.engine.seqs and smol.engine.allocator.num_free == smol.engine.allocator.num_pages


def test_ctrl_c_after_a_step_took_the_pools_leaves_a_working_engine(smol, monkeypatch):
    """Ctrl-C that lands as the device call returns, before the runner keeps the pools it donated: the engine
    starts from fresh pools (it failed every later call with 'Buffer has been deleted or donated')."""
    g = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in smol.generate(TEXTS[:3], g, use_tqdm=False)]
    runner, real = smol.engine.runner, smol.engine.runner._step
    calls = []

    def interrupted(*args, **kwargs):
        result = real(*args, **kwargs)  # the pools are donated to this call
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return result

    monkeypatch.setattr(runner, "_step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        smol.generate(TEXTS[:3], g, use_tqdm=False)
    monkeypatch.undo()
    assert not runner.pools_lost() and smol.engine.allocator.num_free == smol.engine.allocator.num_pages
    assert [o.outputs[0].token_ids for o in smol.generate(TEXTS[:3], g, use_tqdm=False)] == want


def test_an_async_engine_owns_its_engine_until_shut_down(smol):
    from jaxinfer.engine.async_engine import EngineDeadError

    ae = AsyncEngine(smol.engine, smol.tokenizer)
    with pytest.raises(RuntimeError, match="an AsyncEngine drives this engine"):
        smol.generate("Hi", SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(RuntimeError, match="drives this engine already"):
        AsyncEngine(smol.engine, smol.tokenizer)
    # Nor may the LLM free the engine under it; collected (the LLM built in a function), it leaves it alone.
    with pytest.raises(RuntimeError, match="shut it down first"):
        smol.close()
    # Nor swap its weights: the main thread stepped the engine beside the AsyncEngine's and every request failed.
    with pytest.raises(RuntimeError, match="update_weights: an AsyncEngine drives"):
        smol.update_weights(smol.engine.runner.params)
    smol.__del__()
    assert smol.engine is not None and not smol.engine.runner.pools_lost()

    async def main():
        got = []

        async def read():
            async for o in ae.generate([1, 2, 3], SamplingParams(max_tokens=400, ignore_eos=True), "long"):
                got.append(o)

        task = asyncio.ensure_future(read())
        while not got:
            await asyncio.sleep(0.01)
        await asyncio.to_thread(ae.shutdown)  # a stream still open: it ends, its request gives its pages back
        with pytest.raises(EngineDeadError, match="shut down"):
            await asyncio.wait_for(task, 10)

    asyncio.run(main())
    assert smol.engine.allocator.num_free == smol.engine.allocator.num_pages and not smol.engine.seqs
    assert smol.generate("Hi", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


def test_close_frees_device_memory():
    # A first engine imports and initialises what every later one shares (the loaders, the tokenizer, the kernel).
    LLM(str(smollm2_gguf()), num_kv_tokens=1024, max_model_len=256, max_num_seqs=4).close()
    release_freed_memory()
    before, rss_before = len(jax.live_arrays()), _rss_bytes()
    llm = LLM(str(smollm2_gguf()), num_kv_tokens=1024, max_model_len=256, max_num_seqs=4)
    assert len(jax.live_arrays()) > before
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(llm.engine.runner.weights))
    llm.generate("Hi", SamplingParams(max_tokens=2), use_tqdm=False)
    engine = llm.engine  # still held by the caller (an AsyncEngine over it, a notebook's name for it)
    llm.close()
    assert len(jax.live_arrays()) == before, [a.shape for a in jax.live_arrays()]
    # On CPU the host's memory is the device's: close gives it back to the OS, not only to glibc's heap (which kept
    # ~230 MiB of a second engine's 513 MiB of weights before close trimmed it; 60-90 MiB stay now).
    print(f"RSS after close: {(_rss_bytes() - rss_before) / 2**20:+.0f} MiB, weights {weight_bytes / 2**20:.0f} MiB")
    assert _rss_bytes() - rss_before < weight_bytes / 4
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate("Hi")
    del engine


# ---------------------------------------------------------------------------------------------- tiny random model


@pytest.fixture(scope="module")
def tiny():
    from jaxinfer.config import ModelConfig

    cfg = ModelConfig(arch="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8, max_position_embeddings=256)  # fmt: skip
    return cfg, init_params(cfg, seed=0, std=0.5)


def test_thousand_requests_with_random_aborts_return_every_page(tiny):
    cfg, params = tiny
    eng = Engine(cfg, params, CacheConfig(block_size=4, num_pages=48, max_model_len=64, max_num_seqs=16,
                                          max_num_batched_tokens=64), eos_token_ids=(0,))  # fmt: skip
    rng = np.random.default_rng(0)
    live: list[str] = []
    for i in range(1000):
        sp = SamplingParams(max_tokens=int(rng.integers(1, 12)), temperature=float(rng.choice([0.0, 1.0])),
                            n=int(rng.choice([1, 1, 2])), seed=i)  # fmt: skip
        live.append(eng.add_request(rng.integers(1, 64, int(rng.integers(1, 30))).tolist(), sp))
        if rng.random() < 0.3:
            eng.abort(live.pop(int(rng.integers(len(live)))))
        if i % 4 == 0:
            eng.step()
    while eng.has_unfinished():
        eng.step()
    assert eng.allocator.num_free == eng.allocator.num_pages
    assert not eng.seqs and not eng.groups


def _greedy(eng: Engine, prompts: list[list[int]]) -> list[list[int]]:
    rids = [eng.add_request(p, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)) for p in prompts]
    tokens: dict[str, list[int]] = {r: [] for r in rids}
    while eng.has_unfinished():
        for u in eng.step():
            tokens[u.request_id] += u.new_token_ids
    return [tokens[r] for r in rids]


@pytest.mark.parametrize("layer_loop", ["scan", "unroll"])
def test_update_weights_of_a_family_state(tiny, layer_loop):
    from jaxinfer.engine.runner import compile_count

    cfg, params = tiny
    cache = CacheConfig(block_size=4, num_pages=32, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32,
                        layer_loop=layer_loop)  # fmt: skip
    prompts = [list(range(1, 14)), list(range(1, 14)) + [5, 6], [7, 8, 9]]  # a shared prefix of whole pages
    eng = Engine(cfg, params, cache)
    before = _greedy(eng, prompts)
    trained = init_params(cfg, seed=1, std=0.5)
    compiles = compile_count()
    eng.update_weights(trained)
    after = _greedy(eng, prompts)
    assert compile_count() == compiles
    assert after == _greedy(Engine(cfg, trained, cache), prompts) != before  # no stale prefix-cache hit
    eng.runner.release()
    # The caller's arrays (shared with the engine where it made no copy) stay usable.
    assert not any(x.is_deleted() for x in jax.tree.leaves((params, trained)))
    assert _greedy(Engine(cfg, params, cache), prompts) == before


def test_max_tokens_none_runs_to_the_context_length(tiny):
    cfg, params = tiny
    eng = Engine(cfg, params, CacheConfig(block_size=4, num_pages=32, max_model_len=64, max_num_seqs=4,
                                          max_num_batched_tokens=32))  # fmt: skip
    rid = eng.add_request(list(range(1, 11)), SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True))
    got, reason = [], None
    while eng.has_unfinished():
        for u in eng.step():
            got += u.new_token_ids
            reason = u.finish_reason or reason
    assert (len(got), reason) == (64 - 10, "length") and rid
    with pytest.raises(ValueError, match="prompt: 64 tokens leave no room"):
        eng.add_request([1] * 64, SamplingParams(max_tokens=None))
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    SamplingParams(max_tokens=None, min_tokens=5)  # bounded by the context instead
    # A min_tokens past the context ends at the context, as vLLM's, whether max_tokens was None or clamped to it.
    for max_tokens in (None,):  # (clamped by LLM.generate: test_generate_stops_at_the_context_...)
        got = []
        eng.add_request(list(range(1, 61)), SamplingParams(max_tokens=max_tokens, min_tokens=20, temperature=0.0))
        while eng.has_unfinished():
            got += [t for u in eng.step() for t in u.new_token_ids]
        assert len(got) == 4


def test_seeds_take_openais_range():
    from jaxinfer.engine.engine import device_seed

    for seed in (-(2**63), -2, 2**32, 2**63 - 1, 2**64 - 1):
        assert SamplingParams(seed=seed).seed == seed
    assert SamplingParams(seed=-1).seed is None  # vLLM's "no seed"
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=2**64)
    assert [device_seed(s) for s in (0, 7, 2**32 - 1)] == [0, 7, 2**32 - 1]  # as before: reproducible
    big = [device_seed(s) for s in (-1, -2, 2**32, 2**32 + 1, 2**63)]
    assert all(0 <= s < 2**32 for s in big) and len(set(big)) == len(big)


def test_small_temperatures_are_raised_as_vllms():
    raised = [SamplingParams(temperature=t).temperature for t in (0.0, 1e-6, 0.005, 0.01, 0.5)]
    assert raised == [0, 0.01, 0.01, 0.01, 0.5]
    assert SamplingParams(temperature=1e-6).greedy is False


def test_async_engine_streams_and_aborts(tiny):
    from jaxinfer.tokenizer import load_tokenizer

    cfg, params = tiny
    eng = Engine(cfg, params, CacheConfig(block_size=4, num_pages=64, max_model_len=64, max_num_seqs=8,
                                          max_num_batched_tokens=32))  # fmt: skip
    tok = load_tokenizer(smollm2_gguf())  # any tokenizer: the tiny model's ids are < 64
    ae = AsyncEngine(eng, tok)

    async def main():
        outs = []
        async for o in ae.generate([1, 2, 3], SamplingParams(max_tokens=5, temperature=0.0), "a"):
            outs.append(o)
        # Deltas: each output holds only the tokens made since the last one the reader took (one a step, or
        # several merged when the reader fell behind), never the whole output again.
        counts = [len(o.outputs[0].token_ids) for o in outs]
        assert outs[-1].finished and sum(counts) == 5 and min(counts) >= 1, counts

        async def cut():
            async for _ in ae.generate([4, 5], SamplingParams(max_tokens=50, temperature=0.0), "b"):
                break

        await asyncio.gather(*(cut() for _ in range(1)))

        # A retry under the id of a stream closed early (a timeout) is a request of its own: the old one's end
        # (or its tokens) never reaches it.
        async def first_output(rid: str):
            async with contextlib.aclosing(ae.generate([4, 5], SamplingParams(max_tokens=50, temperature=0.0),
                                                       rid)) as outs:  # fmt: skip
                async for o in outs:
                    return o

        await first_output("retry")
        whole = OutputAccumulator()
        async for o in ae.generate([4, 5], SamplingParams(max_tokens=8, temperature=0.0), "retry"):
            whole.add(o)
        done = whole.result().outputs[0]
        assert (done.finish_reason, len(done.token_ids)) == ("length", 8)

        async def aborted_by_another_task():
            outs = []
            async for o in ae.generate([6, 7], SamplingParams(max_tokens=50, temperature=0.0), "d"):
                outs.append(o)
                if len(outs) == 1:
                    ae.abort("d")
            return outs[-1]

        last = await asyncio.wait_for(aborted_by_another_task(), timeout=30)
        assert last.finished and last.outputs[0].finish_reason == "abort"
        with pytest.raises(ValueError, match="max_tokens"):
            async for _ in ae.generate([1] * 10, SamplingParams(max_tokens=60), "c"):
                pass

    asyncio.run(main())
    for _ in range(100):
        if not eng.has_unfinished():
            break
        import time

        time.sleep(0.05)
    assert eng.allocator.num_free == eng.allocator.num_pages
    ae.shutdown()


# 150: three chunks of the 64-token budget; 129: the last chunk is one token, a step of one token a row, which a
# step scoring prompt tokens runs as a mixed step (the only kind with a prompt-logprobs variant).
@pytest.mark.parametrize("length", [150, 129])
def test_prompt_logprobs_match_the_model(smol, length):
    """Prompt logprobs (chunked over several steps) equal log-softmax of the contiguous path's logits, and each
    token's rank is its place among them."""
    from jaxinfer.generate import run_step
    from jaxinfer.model.attention import init_contiguous_cache

    assert smol.engine.runner.bucket_for(1, 1, prompt_logprobs=True)[0] is False
    prompt = smol.tokenizer.encode(" ".join(TEXTS * 3))[:length]
    assert len(prompt) == length
    out = smol.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2),
                        use_tqdm=False)[0]  # fmt: skip
    plp, ranks = out.prompt_logprobs, out.prompt_ranks
    assert plp[0] is None and len(plp) == len(prompt)
    assert ranks[0] is None and len(ranks) == len(prompt)
    runner = smol.engine.runner
    t = 160
    tokens = np.zeros((1, t), np.int32)
    tokens[0, : len(prompt)] = prompt
    pos = np.arange(t, dtype=np.int32)[None]
    lg, _ = run_step(runner.family_params(), runner.cfg, tokens, pos, pos < len(prompt),
                     init_contiguous_cache(runner.cfg, 1, t), all_logits=True)  # fmt: skip
    ref = np.asarray(jax.nn.log_softmax(lg[0], axis=-1))
    # The contiguous path keeps float32 K/V; a float16 pool (the CPU default, jaxinfer.device) rounds them: up to
    # 3.8e-3 apart over these 150 positions (a float32 pool: under 1e-4). A misplaced chunk or row is off by far more.
    tol = 1e-4 if runner.kv[0][0].dtype == np.float32 else 1e-2
    for p in range(1, len(prompt)):
        assert plp[p][prompt[p]] == pytest.approx(float(ref[p - 1, prompt[p]]), abs=tol)
        top2 = np.argsort(-ref[p - 1])[:2]
        assert set(top2) <= set(plp[p])
        # Ranks from the reference's logprobs: exact where no other token lies within the pool's rounding.
        own = ref[p - 1, prompt[p]]
        lo, hi = int(np.sum(ref[p - 1] > own + tol)) + 1, int(np.sum(ref[p - 1] >= own - tol))
        assert lo <= ranks[p] <= hi
    assert sorted(set(ranks[1:])) != [1]  # the prompt is not all the model's first choices: ranks are exercised


def test_allowed_token_ids_restrict_every_sampled_token(smol):
    """allowed_token_ids (vLLM's): greedy takes, at each step, the best allowed token under the model's own logits
    (the contiguous path's), sampling never leaves the set, and a request beside it without them is unchanged."""
    from jaxinfer.generate import run_step
    from jaxinfer.model.attention import init_contiguous_cache

    prompt = smol.tokenizer.encode("The weather today is")
    allowed = smol.tokenizer.encode(" sunny rainy cold warm nice bad")
    greedy = SamplingParams(max_tokens=6, temperature=0.0, allowed_token_ids=allowed, ignore_eos=True)
    plain = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = smol.generate([{"prompt_token_ids": prompt}] * 2, [greedy, plain], use_tqdm=False)
    got = outs[0].outputs[0].token_ids
    assert outs[1].outputs[0].token_ids == smol.generate({"prompt_token_ids": prompt}, plain, use_tqdm=False)[
        0].outputs[0].token_ids  # fmt: skip
    runner = smol.engine.runner
    ids = prompt + got
    t = len(ids)
    pos = np.arange(t, dtype=np.int32)[None]
    lg, _ = run_step(runner.family_params(), runner.cfg, np.asarray([ids], np.int32), pos, pos < t,
                     init_contiguous_cache(runner.cfg, 1, t), all_logits=True)  # fmt: skip
    assert got != outs[1].outputs[0].token_ids  # the model's own choices lie outside the set
    checked = 0
    for i, tok in enumerate(got):
        row = np.asarray(lg[0, len(prompt) - 1 + i])[allowed]
        best, second = np.sort(row)[::-1][:2]
        if best - second > 1e-2:  # beyond the float16 pool's rounding
            assert tok == allowed[int(np.argmax(row))], (i, tok)
            checked += 1
    assert checked >= 4
    sampled = smol.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=8, temperature=1.5, n=6, seed=0,
                            allowed_token_ids=allowed, ignore_eos=True), use_tqdm=False)[0]  # fmt: skip
    tokens = {t for c in sampled.outputs for t in c.token_ids}
    assert tokens <= set(allowed) and len(tokens) > 1
    with pytest.raises(ValueError, match="allowed_token_ids: token ids must be in"):
        smol.generate("x", SamplingParams(allowed_token_ids=[smol.engine.cfg.vocab_size]), use_tqdm=False)
    with pytest.raises(ValueError, match="allowed_token_ids: every allowed token is a stop or EOS id"):
        smol.generate("x", SamplingParams(allowed_token_ids=[5], stop_token_ids=[5], min_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="allowed_token_ids must be a non-empty list"):
        SamplingParams(allowed_token_ids=[])


def _contains(tokens: list[int], seq: tuple[int, ...]) -> bool:
    return any(tuple(tokens[i : i + len(seq)]) == seq for i in range(len(tokens) - len(seq) + 1))


def test_bad_words_keep_words_out_of_the_output(smol):
    """bad_words (vLLM's): a two-token word taken from the greedy output bans its second token right after its
    first (the first still in flight on the device when the next step is dispatched: overlap scheduling), and the
    next best token comes instead; a word given as text is kept out in both its tokenizations."""
    prompt = smol.tokenizer.encode("The capital of France is")
    greedy = dict(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    plain = smol.generate({"prompt_token_ids": prompt}, SamplingParams(**greedy), use_tqdm=False)[0].outputs[0]
    first, second = plain.token_ids[1], plain.token_ids[2]
    ban = SamplingParams(**greedy, bad_words_token_ids=[(first, second)])
    banned = smol.generate({"prompt_token_ids": prompt}, ban, use_tqdm=False)[0].outputs[0]
    assert smol.engine.overlap and banned.token_ids[:2] == plain.token_ids[:2]
    assert not _contains(banned.token_ids, (first, second))
    ranked = sorted(plain.logprobs[2].items(), key=lambda kv: -kv[1])
    (best, lp1), (runner_up, lp2) = ranked[0], ranked[1]
    assert best == second
    if lp1 - lp2 > 1e-2:  # beyond the float16 pool's rounding: the next best is certain
        assert banned.token_ids[2] == runner_up

    word = smol.tokenizer.decode([plain.token_ids[0]]).strip()
    params = SamplingParams(**greedy, bad_words=[word])
    seqs = with_bad_words_ids(params, smol.tokenizer).bad_words_token_ids
    assert (plain.token_ids[0],) in seqs  # the greedy output's first token is the word after a space
    out = smol.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids[0] != plain.token_ids[0] and not any(_contains(out.token_ids, q) for q in seqs)
    with pytest.raises(ValueError, match="bad_words: the engine takes them as token ids"):
        smol.engine.validate(prompt, params)

    async def stream() -> list[int]:  # an AsyncEngine (a notebook's, the server's) tokenizes them too
        whole = OutputAccumulator(params)
        async for delta in ae.generate(prompt, params, "bad-words"):
            whole.add(delta)
        return whole.result().outputs[0].token_ids

    ae = AsyncEngine(smol.engine, smol.tokenizer)
    try:
        assert asyncio.run(stream()) == out.token_ids
    finally:
        ae.shutdown()
    with pytest.raises(ValueError, match="bad_words: at most 32 token sequences"):
        smol.generate("x", SamplingParams(bad_words=[f"w{i}" for i in range(40)]), use_tqdm=False)
    with pytest.raises(ValueError, match="bad_words_token_ids: a word may be at most 16 tokens long"):
        smol.generate("x", SamplingParams(bad_words_token_ids=[tuple(range(5, 22))]), use_tqdm=False)


def test_detokenize_false_gives_the_tokens_without_text(smol):
    """detokenize=False (vLLM's): the same tokens, logprobs and finish reasons, every text empty; stop strings,
    which need the text, are refused."""
    sp = SamplingParams(max_tokens=12, temperature=0.0, logprobs=1)
    texts = smol.generate(TEXTS[:3], sp, use_tqdm=False)
    ids = smol.generate(TEXTS[:3], dataclasses.replace(sp, detokenize=False), use_tqdm=False)
    for a, b in zip(texts, ids, strict=True):
        x, y = a.outputs[0], b.outputs[0]
        assert (y.token_ids, y.logprobs, y.finish_reason) == (x.token_ids, x.logprobs, x.finish_reason)
        assert x.text and y.text == ""
    with pytest.raises(ValueError, match="stop strings need detokenize=True"):
        SamplingParams(stop=["."], detokenize=False)


def test_warmup_compiles_every_program_a_request_can_select(tmp_path):
    """LLM(warmup=True) compiles up front what the server's warm-up does, prompt logprobs' programs included: a
    request asking for them compiled mid-run."""
    from jaxinfer.engine.runner import compile_count
    from tests.tiny_model import SETTINGS, write_tiny_model

    write_tiny_model(tmp_path)
    with LLM(str(tmp_path), warmup=True, **SETTINGS) as llm:
        before = compile_count()
        for sp in (SamplingParams(max_tokens=2, logprobs=3, presence_penalty=0.5),
                   SamplingParams(max_tokens=2, prompt_logprobs=1),
                   SamplingParams(max_tokens=2, prompt_logprobs=1, logprobs=1)):  # fmt: skip
            llm.generate(["Hello there", "word " * 40], sp, use_tqdm=False)
        assert compile_count() == before
        assert llm.generate("Hi", SamplingParams(max_tokens=2), use_tqdm=False)[0].num_cached_tokens is not None


def test_an_async_engine_nobody_holds_is_collected_with_its_engine(tiny):
    """A notebook cell run again (`eng = ...; ae = AsyncEngine(eng, tok)`) without shutting the old one down: its
    thread held it, and it its engine, for the life of the kernel (+2.1 GB of RSS each time with the default
    model). Used once, then dropped: the thread ends and both are collected."""
    import gc
    import threading
    import time
    import weakref

    from jaxinfer.tokenizer import load_tokenizer

    cfg, params = tiny
    tok = load_tokenizer(smollm2_gguf())

    def make() -> tuple[weakref.ref, weakref.ref]:
        eng = Engine(cfg, params, CacheConfig(block_size=4, num_pages=64, max_model_len=64, max_num_seqs=8,
                                              max_num_batched_tokens=32))  # fmt: skip
        ae = AsyncEngine(eng, tok)

        async def one():
            return [o async for o in ae.generate([1, 2, 3], SamplingParams(max_tokens=3, temperature=0.0), "x")]

        assert asyncio.run(one())[-1].finished
        return weakref.ref(eng), weakref.ref(ae)

    threads = threading.active_count()
    refs = [make() for _ in range(3)]
    deadline = time.monotonic() + 10
    while any(r() is not None for pair in refs for r in pair) or threading.active_count() > threads:
        assert time.monotonic() < deadline, "an AsyncEngine nobody holds kept its engine (or its thread ran on)"
        gc.collect()
        time.sleep(0.05)


def test_a_pool_smaller_than_the_context_is_the_context(tmp_path, caplog):
    """num_kv_tokens below max_model_len: a sequence holds at most the pool, so LLM.generate stops a request there
    ("length"), as at the context length, instead of refusing it for max_tokens; max_tokens=None fills the pool; a
    prompt the pool cannot hold is named as the prompt's problem; the start-up log says the limit."""
    from tests.tiny_model import SETTINGS, write_tiny_model

    write_tiny_model(tmp_path)
    settings = {**SETTINGS, "num_kv_tokens": 128}  # max_model_len 256
    with caplog.at_level("WARNING"), LLM(str(tmp_path), **settings) as llm:
        assert "the KV pool holds 128 tokens, fewer than max_model_len 256" in caplog.text
        prompt = list(range(100, 220))  # 120 tokens: 8 of room
        out = llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0), use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 8 and out.outputs[0].finish_reason == "length"
        out = llm.generate([prompt], SamplingParams(max_tokens=None, ignore_eos=True), use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 8
        with pytest.raises(ValueError, match="prompt: 130 tokens leave no room .* maximum context length 128"):
            llm.generate([list(range(100, 230))], SamplingParams(max_tokens=4), use_tqdm=False)


def test_a_chat_template_given_at_construction_or_per_call(tmp_path):
    """LLM(chat_template=...) (serve.py --chat-template: text or a file) renders every chat with it; LLM.chat's
    chat_template= renders that call's; neither a file nor a template is refused before the model loads."""
    from jaxinfer.engine.build import read_chat_template
    from tests.tiny_model import SETTINGS, write_tiny_model

    template = (
        "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}>{% endif %}"
    )
    (tmp_path / "t.jinja").write_text(template)
    assert read_chat_template(str(tmp_path / "t.jinja")) == template == read_chat_template(template)
    with pytest.raises(ValueError, match="chat_template: .* neither a file nor a Jinja template"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    write_tiny_model(tmp_path / "m")
    g = SamplingParams(max_tokens=2, temperature=0)
    convo = [{"role": "user", "content": "Hi"}]
    with LLM(str(tmp_path / "m"), chat_template=str(tmp_path / "t.jinja"), **SETTINGS) as llm:
        assert llm.chat(convo, g, use_tqdm=False)[0].prompt == "[user] Hi\n>"
        other = "{% for m in messages %}{{ m.content }}|{% endfor %}"
        assert llm.chat(convo, g, use_tqdm=False, chat_template=other)[0].prompt == "Hi|"
