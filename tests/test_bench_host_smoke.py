"""Smoke test of benchmarks/bench_host.py: a --quick offline run writes the rows it promises, and the /metrics
gauge parser reads what the server writes. Not a performance test: no timing is compared to anything."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import bench_host


def test_quick_offline_run(tmp_path: Path, capsys) -> None:
    out = tmp_path / "host.json"
    assert bench_host.main(["--quick", "--sections", "offline", "--out", str(out)]) == 0
    assert "== offline decode steps" in capsys.readouterr().out
    res = json.loads(out.read_text())
    rows = res["offline"]
    assert {(r["batch"], r["overlap"]) for r in rows} == {(b, o) for b in (1, 4) for o in (True, False)}
    for r in rows:
        # One prefill step samples the first token, then warmup + steps decode steps with every row; the summary
        # counts the gaps between them, after the warm-up ones.
        assert r["steps"] == bench_host.QUICK_DEFAULTS["steps"] - 1
        assert r["compiles"] == 0  # warmed up: the measured loop compiles nothing
        assert r["bare_ms"] > 0 and r["device_ms"] > 0 and r["host_ms"] > 0 and 0 <= r["idle_share"] <= 1
        assert r["engine_over_bare"] > 0 and r["output_tok_s"] > 0


def test_gauges_parse_prometheus_text() -> None:
    text = (
        "# HELP jaxinfer:device_idle_share Device idle\n# TYPE jaxinfer:device_idle_share gauge\n"
        "jaxinfer:device_idle_share 0.0125\njaxinfer:step_device_ms 3.5\njaxinfer:step_host_ms_total 9.0\n"
    )
    assert bench_host._gauges(text, ["device_idle_share", "step_device_ms", "step_host_ms"]) == {
        "device_idle_share": 0.0125,
        "step_device_ms": 3.5,
    }


@pytest.mark.parametrize("flag, value", [("--overlap", "both"), ("--overlap", ""), ("--sections", "both")])
def test_a_bad_list_is_an_error_naming_the_flag(capsys, flag, value):
    with pytest.raises(SystemExit):
        bench_host.parse_args([flag, value])
    assert flag in capsys.readouterr().err
