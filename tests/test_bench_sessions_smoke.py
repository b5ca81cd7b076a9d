"""Smoke test of benchmarks/bench_sessions.py: a --quick run (random tiny model) prints its table and writes the
JSON it promises. Not a performance test: no time is compared. What it does check is what the benchmark's ratios
stand on: the session turn prefills only its new message, the host turns copy pages back, and the replies are the
same tokens in every mode."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import bench_sessions


def test_quick_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sessions.json"
    assert bench_sessions.main(["--quick", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "session_x" in printed and "faster TTFT than recompute" in printed
    res = json.loads(out.read_text())
    assert res["tokens_identical"] is True and res["meta"]["platform"]
    quick = bench_sessions.QUICK_DEFAULTS
    rows = res["turns"]
    assert [r["turn"] for r in rows] == list(range(1, quick["turns"] + 1))
    for r in rows:
        assert r["recompute_prefilled"] == r["context"]  # the whole prompt, every turn
        for m in bench_sessions.MODES:
            assert r[f"{m}_ttft_s"] > 0
    for r in rows[1:]:
        assert r["session_prefilled"] == quick["message_len"] + 1
    assert rows[-1]["host_hit_pages"] > 0 and rows[-1]["host_prefilled"] < rows[-1]["context"]
    assert len(res["runs"]["host"]) == quick["repeats"]
