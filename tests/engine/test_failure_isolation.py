"""One request's failure inside the engine ends that request with an error and frees its pages; the others finish
with the tokens of a clean run. A failed dispatch (nothing ran on the device) ends that step's requests and the
engine goes on; a poisoned device state is fatal. Tiny random model, overlap on and off."""

from __future__ import annotations

import numpy as np
import pytest

from jaxinfer import SamplingParams
from jaxinfer.config import ModelConfig
from jaxinfer.engine.config import CacheConfig
from jaxinfer.engine.engine import FAULT_REQUEST_ENV, Engine, EngineFatalError
from jaxinfer.model import init_params

CFG = ModelConfig(arch="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, max_position_embeddings=256)  # fmt: skip
CACHE = CacheConfig(block_size=4, num_pages=64, max_model_len=64, max_num_seqs=8, max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, seed=0, std=0.5)


def _workload(num: int = 10) -> list[tuple[list[int], SamplingParams]]:
    rng = np.random.default_rng(0)
    return [(rng.integers(2, 64, int(rng.integers(1, 20))).tolist(),
             SamplingParams(max_tokens=12, temperature=float(i % 2), n=1 + (i % 3 == 0), seed=i, ignore_eos=True,
                            logprobs=2 if i % 4 == 0 else None, top_k=3_000_000_000 if i == 1 else 0))
            for i in range(num)]  # fmt: skip


def _drive(eng: Engine, work, on_step=None) -> dict:
    rids = [eng.add_request(ids, sp, f"r{i}") for i, (ids, sp) in enumerate(work)]
    tokens: dict[str, list[int]] = {}
    errors: dict[str, str] = {}
    step = 0
    while eng.has_unfinished():
        if on_step is not None:
            on_step(eng, step)
        for u in eng.step():
            tokens.setdefault(u.request_id, []).extend(u.new_token_ids)
            if u.error is not None:
                assert u.finished and u.finish_reason == "error"
                errors[u.request_id] = u.error
        step += 1
    assert eng.allocator.num_free == eng.allocator.num_pages  # every page back, the failed ones' included
    assert not eng.seqs and not eng.groups
    return {"rids": rids, "tokens": tokens, "errors": errors}


@pytest.mark.parametrize("overlap", [True, False])
def test_one_failing_request_does_not_disturb_the_others(params, overlap, monkeypatch):
    work = _workload()
    clean = _drive(Engine(CFG, params, CACHE, (0,), seed=0, overlap=overlap), work)
    assert not clean["errors"]
    monkeypatch.setenv(FAULT_REQUEST_ENV, "r3")  # r3 has n = 2: both samples fail
    got = _drive(Engine(CFG, params, CACHE, (0,), seed=0, overlap=overlap), work)
    assert set(got["errors"]) == {"r3#0", "r3#1"} and "injected failure" in got["errors"]["r3#0"]
    assert {k: v for k, v in got["tokens"].items() if not k.startswith("r3")} == {
        k: v for k, v in clean["tokens"].items() if not k.startswith("r3")
    }


def test_a_failed_dispatch_ends_its_step_and_the_engine_goes_on(params):
    work = _workload(4)
    clean = _drive(Engine(CFG, params, CACHE, (0,), seed=0, overlap=False), work)
    eng = Engine(CFG, params, CACHE, (0,), seed=0, overlap=False)
    real = eng.runner.dispatch

    def broken_once(eng, step):
        eng.runner.dispatch = real
        if step == 2:  # mid-decode: every running request is in this step

            def fail(*a, **k):
                raise RuntimeError("packing failed")

            eng.runner.dispatch = fail

    got = _drive(eng, work, broken_once)
    eng.runner.dispatch = real
    assert set(got["errors"]) == {"r0#0", "r0#1", "r1", "r2", "r3#0", "r3#1"}
    assert all("packing failed" in e for e in got["errors"].values())
    # The engine still serves, with the same tokens as before.
    again = _drive(eng, [(ids, sp) for ids, sp in work[:2]])
    assert again["tokens"] == {k: v for k, v in clean["tokens"].items() if k in again["tokens"]}


def test_a_poisoned_device_state_is_fatal(params):
    eng = Engine(CFG, params, CACHE, (0,), seed=0, overlap=False)
    eng.add_request([5, 6, 7], SamplingParams(max_tokens=4), "r0")

    class Poisoned:
        def block_until_ready(self):
            raise RuntimeError("device lost")

    def dispatch(*a, **k):
        eng.runner.feed = Poisoned()  # block_until_ready on it fails as on a dead device
        raise RuntimeError("execution failed")

    eng.runner.dispatch = dispatch
    with pytest.raises(EngineFatalError):
        eng.step()


def test_max_model_len_past_the_model_raises(params):
    with pytest.raises(ValueError, match="max_model_len"):
        Engine(CFG, params, CacheConfig(num_pages=8, max_model_len=512), (0,))
