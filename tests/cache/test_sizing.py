"""Default KV pool sizing (jaxinfer.cache.sizing): CPU addressable size and budget, per-device accelerator math,
the byte-size parser. The pools actually built under DP and TP are checked in tests/sharding/test_pool_sizing.py."""

from __future__ import annotations

import pytest

from jaxinfer.cache.sizing import (
    CPU_DEFAULT_BUDGET,
    PREFIX_CACHE_MARGIN,
    page_bytes_per_device,
    parse_bytes,
    size_kv_pool,
)

GiB = 2**30


@pytest.mark.parametrize(
    ("text", "want"),
    [("4GiB", 4 * GiB), ("512 MiB", 512 * 2**20), ("2e9", 2 * 10**9), ("1.5G", 1_500_000_000), (1234, 1234),
     ("77", 77), ("3kb", 3000)],
)  # fmt: skip
def test_parse_bytes(text, want):
    assert parse_bytes(text) == want


@pytest.mark.parametrize("bad", ["", "GiB", "4 parsecs", "-1GiB", 0, "0", True, "1..2G"])
def test_parse_bytes_rejects_naming_the_parameter(bad):
    with pytest.raises(ValueError, match="kv_cache_memory"):
        parse_bytes(bad)


def test_page_bytes_split_over_kv_shards():
    full = page_bytes_per_device(16, 30, 4, 64, 4, 1)
    assert full == 2 * 30 * 16 * 4 * 64 * 4
    assert page_bytes_per_device(16, 30, 4, 64, 4, 2) == full // 2
    assert page_bytes_per_device(16, 30, 4, 64, 4, 4) == full // 4


@pytest.mark.parametrize(("heads", "shards", "row"), [(3, 1, 256), (3, 3, 128), (8, 1, 512), (8, 2, 256), (2, 1, 128)])
def test_page_bytes_count_a_tpu_rows_padding(heads, shards, row):
    """On a TPU each device's token rows are padded to 128 lanes (kernels_pallas.pool_shape): SmolLM2's 3 x 64 heads
    take 256 lanes, so a pool sized from HBM must count 256, not 192."""
    assert page_bytes_per_device(16, 30, heads, 64, 2, shards, 128) == 2 * 30 * 16 * row * 2
    assert page_bytes_per_device(16, 30, heads, 64, 2, shards, 1) == 2 * 30 * 16 * (heads // shards) * 64 * 2


def test_the_runner_stores_rows_padded_on_tpu_only():
    from jaxinfer.config import ModelConfig
    from jaxinfer.engine.runner import pool_shape

    cfg = ModelConfig(arch="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=9,
                      num_kv_heads=3, head_dim=64)  # fmt: skip
    assert pool_shape(cfg, 10, 16, backend="cpu") == (10, 16, 192)
    assert pool_shape(cfg, 10, 16, backend="gpu") == (10, 16, 192)
    assert pool_shape(cfg, 10, 16, backend="tpu") == (10, 16, 256)


def _cpu(**kw):
    args = dict(backend="cpu", page_bytes=2**20, page_size=16, max_num_seqs=32, max_model_len=4096,
                free_bytes_per_device=[64 * GiB], gpu_memory_utilization=0.5, budget=None)  # fmt: skip
    return size_kv_pool(**{**args, **kw})


def test_cpu_default_is_what_the_scheduler_addresses_plus_margin():
    got = _cpu(page_bytes=1024, max_num_seqs=4, max_model_len=100)
    addressable = 4 * 7  # ceil(100 / 16) pages per sequence
    assert got.num_pages == addressable + int(addressable * PREFIX_CACHE_MARGIN)
    assert "scheduler can address" in got.reason


def test_cpu_default_is_capped_by_the_default_budget():
    got = _cpu()  # 32 * 256 pages of 1 MiB wanted: 10 GiB
    assert got.num_pages == CPU_DEFAULT_BUDGET // 2**20
    assert "CPU default budget" in got.reason


@pytest.mark.parametrize("budget", [GiB, 3 * GiB + 5])
def test_cpu_budget_flag_caps_the_pool(budget):
    got = _cpu(budget=budget)
    assert got.num_pages == budget // 2**20
    assert "kv_cache_memory" in got.reason


def test_cpu_small_host_caps_by_fraction():
    got = _cpu(free_bytes_per_device=[GiB])
    assert got.num_pages == GiB // 2 // 2**20
    assert "gpu_memory_utilization" in got.reason


def test_accelerator_uses_the_tightest_device_per_device_bytes():
    free = [80 * GiB, 70 * GiB, 75 * GiB, 79 * GiB]
    tp1 = size_kv_pool(backend="gpu", page_bytes=2**20, page_size=16, max_num_seqs=8, max_model_len=128,
                       free_bytes_per_device=free[:1], gpu_memory_utilization=0.9)  # fmt: skip
    assert tp1.num_pages == int(80 * GiB * 0.9) // 2**20  # not bounded by what the scheduler addresses
    # Under TP=4 a device holds a quarter of each page, so the same memory holds 4x the pages, and the tightest
    # device (70 GiB) decides.
    tp4 = size_kv_pool(backend="gpu", page_bytes=2**18, page_size=16, max_num_seqs=8, max_model_len=128,
                       free_bytes_per_device=free, gpu_memory_utilization=0.9)  # fmt: skip
    assert tp4.num_pages == int(70 * GiB * 0.9) // 2**18
    capped = size_kv_pool(backend="tpu", page_bytes=2**18, page_size=16, max_num_seqs=8, max_model_len=128,
                          free_bytes_per_device=free, gpu_memory_utilization=0.9, budget=GiB)  # fmt: skip
    assert capped.num_pages == GiB // 2**18 and "per device" in capped.reason


def test_server_flag_takes_sizes_and_rejects_nonsense(capsys):
    from jaxinfer.engine.config import EngineArgs
    from jaxinfer.server.args import parse_args

    assert parse_args(["--kv-cache-memory", "4GiB"]).kv_cache_memory == 4 * GiB
    assert parse_args([]).kv_cache_memory is None
    for flag in ("--kv-cache-memory", "--host-kv-cache-memory"):
        with pytest.raises(SystemExit):
            parse_args([flag, "lots"])
        said = capsys.readouterr().err.splitlines()[-1]  # the usage above it lists every flag
        assert said.count(flag) == 1 and "expected bytes" in said, said  # argparse names it, once
    # The Python API has no argparse to name the parameter: the parser does.
    with pytest.raises(ValueError, match="^kv_cache_memory: expected bytes"):
        EngineArgs(kv_cache_memory="lots")


@pytest.mark.parametrize("backend", ["cpu", "tpu"])
@pytest.mark.parametrize(
    ("heads", "head_dim", "shards"), [(3, 64, 1), (4, 64, 2), (6, 64, 2), (8, 128, 4), (1, 256, 1)]
)
def test_page_bytes_are_the_bytes_of_the_pools_allocated(backend, heads, head_dim, shards):
    """Sizing (jax-free, so it keeps its own row arithmetic) counts exactly the rows kernels_pallas.pool_shape gives
    the runner's pools: one device's share of a page, K and V of every layer."""
    from kernels_pallas import POOL_LANE_MULTIPLE, pool_shape

    lanes = POOL_LANE_MULTIPLE.get(backend, 1)
    row = pool_shape(1, 16, heads, head_dim, lanes, shards)[2] // shards
    assert page_bytes_per_device(16, 30, heads, head_dim, 2, shards, lanes) == 2 * 30 * 16 * row * 2
