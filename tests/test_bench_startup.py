"""benchmarks/bench_startup.py's choice of caches: a cold start is measured on empty caches whatever runs before it
(`--runs cold,cold` measured a warm start as the second cold one), a warm start on the last cold run's."""

from __future__ import annotations

import pytest

from benchmarks.bench_startup import cache_sets


@pytest.mark.parametrize("runs,expected", [
    (["cold", "warm", "warm-noexec", "warm"], [0, 0, 0, 0]),
    (["cold", "cold"], [0, 1]),
    (["cold", "warm", "cold", "warm", "warm"], [0, 0, 2, 2, 2]),
    (["warm", "cold", "warm"], [0, 1, 1]),
])  # fmt: skip
def test_every_cold_run_starts_on_empty_caches_and_warm_runs_on_the_last_cold_ones(runs, expected):
    assert cache_sets(runs) == expected
