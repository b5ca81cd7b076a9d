"""Smoke test of benchmarks/ab_step.py: a tiny paired run writes one row per variant, and its trace-time patches
are undone. Not a performance test: no timing is compared to anything."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import pytest

import kernels_pallas
from benchmarks import ab_step
from jaxinfer.engine import runner
from kernels_pallas import cpu


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the cpu.* variant tunes the CPU attention")
def test_paired_run_writes_a_row_per_variant(tmp_path: Path) -> None:
    out = tmp_path / "ab.json"
    variants = "default,no_attention+argmax_sampler,cpu.DECODE_KV_CHUNK_TOKENS=32"
    argv = ["--shape", "tiny", "--batch", "2", "--context", "24", "--rounds", "2", "--variants", variants,
            "--out", str(out)]  # fmt: skip
    assert ab_step.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["variant"] for r in rows] == variants.split(",")
    assert all(r["batch"] == 2 and r["median_ms"] >= r["min_ms"] > 0 for r in rows)
    assert rows[0]["vs_first"] == 1.0


def test_patches_are_undone_and_unknown_parts_refused() -> None:
    before = (kernels_pallas.paged_decode_attention, kernels_pallas.write_kv, runner.sample, cpu.KV_CHUNK_TOKENS)
    with ab_step.patched(["no_attention", "no_kv_write", "argmax_sampler", "cpu.KV_CHUNK_TOKENS=32"]):
        assert cpu.KV_CHUNK_TOKENS == 32 and runner.sample is not before[2]
    assert (
        kernels_pallas.paged_decode_attention,
        kernels_pallas.write_kv,
        runner.sample,
        cpu.KV_CHUNK_TOKENS,
    ) == before
    with pytest.raises(ValueError, match="unknown part"), ab_step.patched(["no_such_thing"]):
        pass
    with pytest.raises(AttributeError), ab_step.patched(["cpu.NO_SUCH_CONSTANT=1"]):
        pass
