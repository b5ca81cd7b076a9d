"""Smoke test of benchmarks/ab_step.py: a tiny paired run writes one row per variant, each variant's trace-time
patches reach its compiled program, and they are undone. Not a performance test: no timing is compared."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jax
import numpy as np
import pytest

import kernels_pallas
from benchmarks import ab_step
from jaxinfer.engine import runner
from jaxinfer.engine.transfer import from_flat
from jaxinfer.model import layers
from kernels_pallas import cpu, project_cpu, ragged_cpu


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the cpu.* variant tunes the CPU attention")
def test_paired_run_writes_a_row_per_variant(tmp_path: Path) -> None:
    out = tmp_path / "ab.json"
    variants = "default,no_attention+argmax_sampler,impl=cpu_jnp+cpu.DECODE_KV_CHUNK_TOKENS=32,separate_gate_up"
    argv = ["--shape", "tiny", "--batch", "2", "--context", "16-24", "--rounds", "2", "--variants", variants,
            "--out", str(out)]  # fmt: skip
    assert ab_step.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["variant"] for r in rows] == variants.split(",")
    assert all(r["batch"] == 2 and r["median_ms"] >= r["min_ms"] > 0 for r in rows)
    assert rows[0]["vs_first"] == 1.0


def test_recorded_step_samples_at_the_temperature_asked() -> None:
    engine, kw = ab_step.recorded_step("scan", 2, 24, "tiny", temperature=0.7)
    _, st = from_flat(kw["flat"], kw["layout"])
    np.testing.assert_allclose(np.asarray(st.temperature)[:2], 0.7)


def test_patches_are_undone_and_unknown_parts_refused() -> None:
    before = (kernels_pallas.paged_decode_attention, kernels_pallas.write_kv, runner.sample, cpu.KV_CHUNK_TOKENS,
              layers.WEIGHT_LEFT_MAX_ROWS)  # fmt: skip
    parts = ["no_attention", "no_kv_write", "argmax_sampler", "cpu.KV_CHUNK_TOKENS=32", "layers.WEIGHT_LEFT_MAX_ROWS=1"]
    with ab_step.patched(parts):
        assert cpu.KV_CHUNK_TOKENS == 32 and layers.WEIGHT_LEFT_MAX_ROWS == 1 and runner.sample is not before[2]
    assert (
        kernels_pallas.paged_decode_attention,
        kernels_pallas.write_kv,
        runner.sample,
        cpu.KV_CHUNK_TOKENS,
        layers.WEIGHT_LEFT_MAX_ROWS,
    ) == before
    with pytest.raises(ValueError, match="unknown part"), ab_step.patched(["no_such_thing"]):
        pass
    with pytest.raises(AttributeError), ab_step.patched(["cpu.NO_SUCH_CONSTANT=1"]):
        pass
    with pytest.raises(AttributeError), ab_step.patched(["layers.NO_SUCH_CONSTANT=1"]):
        pass
    with pytest.raises(ValueError, match="cpu_jnp"), ab_step.patched(["impl=no_such_impl"]):
        pass


def test_each_variant_compiles_its_own_program() -> None:
    # jax caches traces per Python function: a variant must not get the engine's own trace back unchanged.
    engine, kw = ab_step.recorded_step("scan", 2, 24, "tiny")
    no_kernel = "layers.PROJECTION_KERNEL_ROWS=0"
    text = {v: ab_step.compiled_variant(engine, kw, v.split("+"))[1].as_text()
            for v in ("default", "argmax_sampler", "no_attention+no_kv_write", "impl=cpu_jnp", no_kernel,
                      no_kernel + "+layers.WEIGHT_LEFT_MAX_ROWS=1")}  # fmt: skip
    assert "xor(" in text["default"] and "xor(" not in text["argmax_sampler"]  # the draw's random bits (threefry)
    assert text["default"].count("scatter(") > text["no_attention+no_kv_write"].count("scatter(")  # the K/V write
    if jax.default_backend() == "cpu":  # the numba kernels, or XLA's forms in their place
        # The K and V projections (the projection kernel's calls), dropped with the write that reads them.
        calls = {v: t.count(f'custom_call_target="{project_cpu.TARGET}"') for v, t in text.items()}
        if project_cpu.library_k_block(32) is not None:
            assert calls["default"] > calls["no_attention+no_kv_write"] > 0 and calls[no_kernel] == 0
        else:  # K and V (32 outputs) take the library's dot here: the kernel's order for them is not this machine's
            assert calls["default"] == calls["no_attention+no_kv_write"] > 0 and calls[no_kernel] == 0
        # Without the kernel, two rows' projections as W @ x^T padded to 16 rows (dots of an f32[out, 16] result)
        # where that form sums as x @ W^T does; as x @ W^T (f32[2, out]) with the weight-left constant at 1.
        weight_left = re.compile(r"= f32\[\d+,16\]\{1,0\} dot\(")
        assert bool(weight_left.search(text[no_kernel])) == layers.weight_left_sums_as_library()
        assert not weight_left.search(text[no_kernel + "+layers.WEIGHT_LEFT_MAX_ROWS=1"])
        assert ragged_cpu.TARGET in text["default"] and ragged_cpu.TARGET not in text["impl=cpu_jnp"]
    else:
        assert text["default"].count(" dot(") > text["no_attention+no_kv_write"].count(" dot(")  # attention's dots


def test_separate_gate_up_builds_an_engine_without_the_fusion() -> None:
    from jaxinfer.model import scanned

    fused, _ = ab_step.recorded_step("scan", 2, 24, "tiny")
    with ab_step.patched(["separate_gate_up"]):
        apart, _ = ab_step.recorded_step("scan", 2, 24, "tiny")
    assert scanned.FUSE_GATE_UP  # restored after the build
    # gate/up one kernel per layer against two
    assert len(apart.runner.weights) == len(fused.runner.weights) + fused.cfg.num_layers


def test_context_range_is_seeded_and_checked() -> None:
    assert ab_step.context_lengths("24", 3) == [24, 24, 24]
    drawn = ab_step.context_lengths("16-384", 32)
    assert drawn == ab_step.context_lengths("16-384", 32) and len(set(drawn)) > 1
    assert all(16 <= n <= 384 for n in drawn)
    for bad in ("0-4", "9-3", "x", "5-", "-5"):
        with pytest.raises(ValueError):
            ab_step.context_lengths(bad, 2)
