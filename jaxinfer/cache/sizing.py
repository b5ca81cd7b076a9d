"""How many KV pages the pool gets by default, and why. Plain Python: the runner passes in what it measured.

- CPU: what the scheduler can address (`max_num_seqs` sequences of `max_model_len` tokens, plus a margin of pages
  the prefix cache keeps warm), capped by a byte budget (`kv_cache_memory`, default `CPU_DEFAULT_BUDGET`) and by
  `gpu_memory_utilization` of the host memory available to each device. Taking half the host's free memory for a 135M
  model (the old default, ~13 GB) left a notebook no room for a second model.
- Accelerators: `gpu_memory_utilization` of the free memory of the tightest device that holds a shard of the pool,
  divided by the bytes of a page on one device (under tensor parallelism each device holds only its KV heads), and
  capped by `kv_cache_memory` when given. Each data-parallel replica is sized from its own devices.

`kv_cache_memory` is bytes per device, as vLLM's `kv_cache_memory_bytes`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# vLLM's CPU default is 4 GiB. 1.5 GiB keeps `LLM()` on the default model (SmolLM2-135M, fp32, 45 KiB of KV per
# token) under 3 GiB of peak RSS (2 GiB measured 3.2 GiB) while still holding 34k tokens, more than the 64
# sequences of the offline workload (16-256 prompt + 128 output tokens, 25k tokens at most) need.
CPU_DEFAULT_BUDGET = 3 * 2**29
# Extra pages beyond what the running sequences can address, so finished prompts stay in the prefix cache a while.
PREFIX_CACHE_MARGIN = 0.25

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
          "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip


def parse_bytes(value: int | float | str | None, name: str | None = "kv_cache_memory") -> int | None:
    """Bytes from an int or text like "4GiB", "512 MiB", "2e9", "1.5G" (None stays None). Raises ValueError naming
    `name` on anything else; `name=None` leaves the naming to the caller (argparse names the flag itself)."""
    if value is None:
        return None
    said = f"{name}: " if name is not None else ""
    if isinstance(value, bool):
        raise ValueError(f"{said}expected bytes or a size like '4GiB', got {value!r}")
    if isinstance(value, int | float):
        n = value
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", str(value))
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"{said}expected bytes or a size like '4GiB' or '512MiB', got {value!r}")
        n = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if n < 1:
        raise ValueError(f"{said}must be at least 1 byte, got {value!r}")
    return int(n)


def parse_size(value: int | float | str | None, name: str | None) -> int | None:
    """As `parse_bytes`, but 0 (or "0") is allowed: it turns the thing off."""
    if value is not None and not isinstance(value, bool) and str(value).strip() in ("0", "0.0"):
        return 0
    return parse_bytes(value, name)


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


@dataclass(frozen=True)
class PoolSize:
    num_pages: int
    reason: str  # one line for the start-up log


def page_bytes_per_device(page_size: int, num_layers: int, num_kv_heads: int, head_dim: int, itemsize: int,
                          kv_shards: int, lane_multiple: int = 1) -> int:  # fmt: skip
    """Bytes of one page (K and V of every layer) held by one device when the KV heads split `kv_shards` ways
    (`num_kv_heads` is the count the pool is allocated with, after any replication for tensor parallelism), with
    each device's token rows padded to `lane_multiple` elements (kernels_pallas.POOL_LANE_MULTIPLE)."""
    heads = -(-num_kv_heads // kv_shards)
    row = -(-heads * head_dim // lane_multiple) * lane_multiple
    return 2 * num_layers * page_size * row * itemsize


def size_kv_pool(
    *,
    backend: str,
    page_bytes: int,
    page_size: int,
    max_num_seqs: int,
    max_model_len: int,
    free_bytes_per_device: list[int],
    gpu_memory_utilization: float,
    budget: int | None = None,
) -> PoolSize:
    """Pages of one pool (one replica). `page_bytes`: one page's bytes on one device; `free_bytes_per_device`: the
    free memory of each device holding a shard of this pool (on CPU: the host memory left to each device)."""
    if page_bytes < 1 or not free_bytes_per_device:
        raise ValueError("page_bytes must be >= 1 and at least one device is needed")
    free = min(free_bytes_per_device)
    by_fraction = int(free * gpu_memory_utilization) // page_bytes
    if backend == "cpu":
        pages_per_seq = -(-max_model_len // page_size)
        addressable = max_num_seqs * pages_per_seq
        wanted = addressable + int(addressable * PREFIX_CACHE_MARGIN)
        cap = budget if budget is not None else CPU_DEFAULT_BUDGET
        by_budget = cap // page_bytes
        num = max(1, min(wanted, by_budget, by_fraction))
        why = f"{max_num_seqs} seqs x {max_model_len} tokens + {PREFIX_CACHE_MARGIN:.0%} prefix-cache margin"
        if num == wanted:
            reason = f"what the scheduler can address ({why})"
        elif num == by_budget:
            src = "kv_cache_memory" if budget is not None else "the CPU default budget (set kv_cache_memory)"
            reason = f"capped by {src} = {format_bytes(cap)} (wanted {why} = {wanted} pages)"
        else:
            reason = (f"capped by gpu_memory_utilization {gpu_memory_utilization} of {format_bytes(free)} available "
                      f"host memory (wanted {why} = {wanted} pages)")  # fmt: skip
        return PoolSize(num, reason)
    num = by_fraction
    reason = (f"gpu_memory_utilization {gpu_memory_utilization} of {format_bytes(free)} free on the tightest of "
              f"{len(free_bytes_per_device)} device(s), {format_bytes(page_bytes)} per page per device")  # fmt: skip
    if budget is not None and budget // page_bytes < num:
        num = budget // page_bytes
        reason = f"capped by kv_cache_memory = {format_bytes(budget)} per device ({format_bytes(page_bytes)} per page)"
    return PoolSize(max(1, num), reason)
