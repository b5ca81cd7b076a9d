"""Smoke test of benchmarks/bench_dots.py: a quick run writes a row per projection and row count, and a compile
option reaches XLA's compiler (the column names the library its module calls). No timing is compared."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import pytest

from benchmarks import bench_dots


def test_projections_are_the_models_kernels() -> None:
    # SmolLM2-135M: 9 query heads and 3 KV heads of 64, hidden 576, MLP 1536, vocab 49152.
    assert bench_dots.projections("smollm2-135m") == {
        "qkv": (9 * 64 + 2 * 3 * 64, 576), "o": (576, 576), "gate_up": (2 * 1536, 576), "down": (576, 1536),
        "lm_head": (49152, 576),
    }  # fmt: skip


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's dot libraries")
def test_quick_run_writes_rows_and_applies_the_option(tmp_path: Path) -> None:
    out = tmp_path / "dots.json"
    argv = ["--quick", "--options", "xla_cpu_experimental_ynn_fusion_type=", "--out", str(out)]
    assert bench_dots.main(argv) == 0
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert [(r["proj"], r["rows"]) for r in rows] == [(p, m) for p in bench_dots.projections("tiny") for m in (2, 16)]
    assert all(r["xla_gflops"] > 0 and r["numpy_gflops"] > 0 and r["opt_gflops"] > 0 for r in rows)
    # With YNNPACK's fusions off, no product goes to it; by default the 16-row products do.
    assert all(r["opt_lib"] != "ynn" for r in rows)
    assert any(r["xla_lib"] == "ynn" for r in rows if r["rows"] == 16)
    assert data["meta"]["config"]["shape"] == "tiny"
    assert set(data["meta"]["host"]["cpu_flags"]) <= {
        "avx2",
        "fma",
        "avx512f",
        "avx512_vnni",
        "avx512_bf16",
        "avx512_fp16",
        "avx_vnni",
        "amx_tile",
    }


def test_option_values_take_xlas_types() -> None:
    assert bench_dots.option_value("true") is True and bench_dots.option_value("False") is False
    assert bench_dots.option_value("2") == 2
    assert bench_dots.option_value("LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT") == "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"
    assert bench_dots.option_value("") == ""
