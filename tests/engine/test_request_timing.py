"""The timeline the engine reports with each sequence's first token (`SeqTiming`: queue time, prefill chunks,
first token, prefix-cache hits), through the engine-process wire and onto the API side's clock. Tiny random model."""

from __future__ import annotations

import time

import pytest

from jaxinfer import SamplingParams
from jaxinfer.config import ModelConfig
from jaxinfer.engine.config import CacheConfig
from jaxinfer.engine.core_process import pack, unpack, update_from_wire, update_to_wire
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.output import OutputProcessor
from jaxinfer.model import init_params
from jaxinfer.types import SeqTiming, SeqUpdate

CFG = ModelConfig(arch="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, max_position_embeddings=256)  # fmt: skip
# A 16-token step budget: a 40-token prompt takes three prefill steps (16 + 16 + 8).
CACHE = CacheConfig(block_size=4, num_pages=64, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16)
PROMPT = [(7 * i) % 61 + 2 for i in range(40)]


@pytest.fixture(scope="module")
def engine():
    return Engine(CFG, init_params(CFG, seed=0, std=0.5), CACHE, (0,), seed=0)


def _never(*stop) -> None:
    raise AssertionError(f"no stop strings here, yet the processor ended {stop}")


def _first_updates(eng: Engine, rid: str) -> list[SeqUpdate]:
    eng.add_request(PROMPT, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), rid)
    updates = []
    while eng.has_unfinished():
        updates += [u for u in eng.step() if u.request_id == rid]
    return updates


def test_first_token_carries_the_prefill_timeline(engine):
    t0 = time.monotonic()
    updates = _first_updates(engine, "cold")
    elapsed = time.monotonic() - t0
    assert [u.timing is not None for u in updates] == [True, False, False]  # once, with the first token
    t = updates[0].timing
    assert [c[2] for c in t.prefill_chunks] == [16, 16, 8] and t.num_cached_tokens == 0
    assert t.num_host_cached_tokens is None  # no host KV tier
    starts = [c[0] for c in t.prefill_chunks]
    assert 0 <= t.queued_s == starts[0] and starts == sorted(starts)
    assert all(start <= done <= t.first_token_s for start, done, _ in t.prefill_chunks)
    assert t.first_token_s <= elapsed
    # The same prompt again: 9 full pages (36 tokens) come from the prefix cache, one chunk computes the rest.
    warm = _first_updates(engine, "warm")[0].timing
    assert warm.num_cached_tokens == 36 and [c[2] for c in warm.prefill_chunks] == [4]
    engine.reset_prefix_cache()  # a benchmark's next round: the prompt computes in full again
    again = _first_updates(engine, "again")[0].timing
    assert again.num_cached_tokens == 0 and [c[2] for c in again.prefill_chunks] == [16, 16, 8]
    assert engine.allocator.num_free == engine.allocator.num_pages


def test_timing_crosses_the_wire_and_lands_on_the_api_clock(engine):
    timing = SeqTiming(0.25, 0.5, 12, [[0.25, 0.375, 16], [0.375, 0.5, 8]])
    u = SeqUpdate("r", [5], [], False, None, timing=timing)
    back = update_from_wire(unpack(pack(update_to_wire(u))))
    assert back == u
    assert update_from_wire(unpack(pack(update_to_wire(SeqUpdate("r", [6], [], True, "length"))))).timing is None
    from jaxinfer.model_files import smollm2_gguf
    from jaxinfer.tokenizer import load_tokenizer

    proc = OutputProcessor(load_tokenizer(smollm2_gguf()))
    proc.add("r", None, PROMPT, SamplingParams(max_tokens=2))
    (out,) = proc.process([back], _never)
    m = out.metrics
    assert m.first_scheduled_time - m.arrival_time == pytest.approx(0.25)
    assert m.first_token_time - m.arrival_time == pytest.approx(0.5)
    assert [(a - m.arrival_time, b - m.arrival_time, n) for a, b, n in m.prefill_chunks] == pytest.approx(
        [(0.25, 0.375, 16), (0.375, 0.5, 8)]
    )
    assert m.num_cached_tokens == 12 and m.finished_time is None and m.detokenize_s > 0
    (out,) = proc.process([SeqUpdate("r", [6], [], True, "length")], _never)
    assert out.finished and out.metrics.finished_time >= m.arrival_time and out.metrics.num_cached_tokens == 12


def test_host_tier_hits_are_reported_per_request():
    """A prompt whose pages were pushed off the device comes back from the host tier: its first token says how
    many of its cached tokens the host tier restored."""
    eng = Engine(CFG, init_params(CFG, seed=0, std=0.5),
                 CacheConfig(block_size=4, num_pages=32, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16,
                             host_kv_cache_memory=1 << 20), (0,), seed=0)  # fmt: skip
    assert eng.host is not None
    assert _first_updates(eng, "cold")[0].timing.num_host_cached_tokens == 0
    # Other prompts take the whole pool: the first prompt's pages go to the host tier.
    eng.generate([[(5 * i) % 61 + 2 for i in range(60)], [(3 * i) % 61 + 2 for i in range(60)]],
                 SamplingParams(max_tokens=1, temperature=0.0))  # fmt: skip
    warm = _first_updates(eng, "warm")[0].timing
    assert warm.num_cached_tokens == 36 and warm.num_host_cached_tokens > 0
    eng.reset_prefix_cache()  # the host tier's copies go too
    again = _first_updates(eng, "again")[0].timing
    assert again.num_cached_tokens == 0 and again.num_host_cached_tokens == 0
    assert warm.num_host_cached_tokens <= warm.num_cached_tokens


def test_a_preempted_prompt_reports_the_cache_hits_of_its_first_admission():
    """A prompt preempted mid-prefill finds its own pages again when it is readmitted: those are not cache hits
    (they counted as such in usage.prompt_tokens_details.cached_tokens)."""
    eng = Engine(CFG, init_params(CFG, seed=0, std=0.5), CacheConfig(block_size=4, num_pages=14, max_model_len=64,
                 max_num_seqs=4, max_num_batched_tokens=8), (0,), seed=0, overlap=False)  # fmt: skip
    eng.add_request([1, 2, 3, 4], SamplingParams(max_tokens=44, temperature=0.0, ignore_eos=True), "older")
    for _ in range(20):
        eng.step()
    eng.add_request(list(range(10, 50)), SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), "new")
    req, timing = eng.seqs["new"], None
    while eng.has_unfinished():
        timing = next((u.timing for u in eng.step() if u.request_id == "new" and u.timing), timing)
    assert req.num_preemptions > 0  # the older request's decode took the pages back
    assert timing.num_cached_tokens == 0
