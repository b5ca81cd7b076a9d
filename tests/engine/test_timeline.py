"""The step timeline: one record per dispatched step, ordered timestamps, a summary that adds up."""

from __future__ import annotations

import pytest

from jaxinfer import SamplingParams
from jaxinfer.config import ModelConfig
from jaxinfer.engine.config import CacheConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.timeline import StepTimeline
from jaxinfer.model import init_params


@pytest.mark.parametrize("overlap", [True, False])
def test_every_step_is_recorded_in_order(overlap):
    cfg = ModelConfig(arch="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8, max_position_embeddings=128)  # fmt: skip
    cache = CacheConfig(block_size=4, num_pages=64, max_model_len=64, max_num_seqs=8, max_num_batched_tokens=32)
    eng = Engine(cfg, init_params(cfg, seed=0, std=0.5), cache, overlap=overlap)
    eng.runner.timeline = tl = StepTimeline(max_steps=1000)
    eng.generate([[1, 2, 3, 4, 5]] * 6, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    s = tl.summary()
    assert len(tl.steps) == eng.num_steps
    assert [r.kind for r in tl.steps][:1] == ["mixed"] and tl.steps[-1].kind == "decode"
    for prev, cur in zip(tl.steps, list(tl.steps)[1:], strict=False):
        assert cur.host_start <= cur.dispatched <= cur.ready
        assert cur.ready >= prev.ready  # the device runs steps in order
    assert s["steps"] == eng.num_steps - 1  # gaps between consecutive steps
    assert 0.0 <= s["idle_share"] <= 1.0 and s["device_ms"] > 0 and s["host_ms"] > 0
    decode = tl.summary(kind="decode")
    assert 0 < decode["steps"] < s["steps"]
    assert tl.live_summary()["steps"] == s["steps"]
    # A window keeps the most recent steps only.
    small = StepTimeline(max_steps=3)
    eng.runner.timeline = small
    eng.generate([[1, 2, 3]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    small.wait()
    assert len(small.steps) == 3 and small.summary()["steps"] == 2
