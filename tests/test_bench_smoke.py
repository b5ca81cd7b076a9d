"""Smoke test of benchmarks/bench_attention.py: a --quick run on CPU writes the JSON it promises.

Not a performance test (no timing is compared to anything); it only keeps the benchmark runnable as the
kernels_pallas API evolves. A few seconds, most of it XLA compilation of the tiny shapes.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import pytest

from benchmarks import bench_attention


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="expected impls and runtime are pinned for CPU")
def test_quick_run_writes_expected_rows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "results.json"
    assert bench_attention.main(["--quick", "--dtype", "float32", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "== decode" in printed and "== ragged prefill" in printed

    res = json.loads(out.read_text())
    meta = res["meta"]
    assert meta["device_kind"] and meta["platform"] == "cpu"
    assert meta["jax_version"] == jax.__version__ and meta["date"]
    cfg = meta["config"]
    quick = bench_attention.QUICK_DEFAULTS

    # On CPU the dispatcher has the numba kernel ("cpu" at float32), the jnp path and the reference; xla_dense is the
    # contiguous-cache baseline.
    decode_keys = {(r["impl"], r["batch"], r["context"]) for r in res["decode"]}
    impls = ("cpu", "cpu_jnp", "reference", "xla_dense")
    expected = {(impl, b, c) for impl in impls for b in cfg["batch"] for c in cfg["context"]}
    assert decode_keys == expected and len(res["decode"]) == len(expected)
    assert cfg["batch"] == [int(x) for x in quick["batch"].split(",")]
    for r in res["decode"]:
        assert r["kernel"] == {"cpu": "cpu_numba"}.get(r["impl"], r["impl"])
        for field in ("median_s", "min_s", "compile_s", "gb_per_s", "bytes", "mean_len", "speedup_vs_reference"):
            assert r[field] > 0, (field, r)
        assert 0.875 * r["context"] - 1 <= r["mean_len"] <= r["context"]
        assert r["max_abs_diff_vs_reference"] < 1e-4  # f32 outputs of O(1) values
    assert all(r["speedup_vs_reference"] == 1.0 for r in res["decode"] if r["impl"] == "reference")

    prefill_keys = {(r["impl"], r["num_seqs"], r["q_len"]) for r in res["prefill"]}
    seqs, lens = cfg["prefill_seqs"], cfg["prefill_len"]
    assert prefill_keys == {(i, s, n) for i in ("cpu", "cpu_jnp", "reference") for s in seqs for n in lens}
    for r in res["prefill"]:
        for field in ("median_s", "compile_s", "tokens_per_s", "tflop_per_s", "flops", "num_tokens"):
            assert r[field] > 0, (field, r)
