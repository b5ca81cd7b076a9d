"""Copies of whole KV pages between the device pools and host memory, for the host tier (jaxinfer.cache.host_tier).

Two compiled programs, each in a few sizes (powers of two up to a request's pages) so that serving never compiles:
- gather: pages -> one device array [layers, 2 (k, v), n, page_size, W] (W: a token's row, runner.pool_shape), moved
  to the host afterwards;
- scatter: host blocks -> pages, written into the donated pools in place (padding rows target an index past the
  pool, which `mode="drop"` ignores).
The device runs them in the order they are dispatched with the steps: a gather dispatched before a step reads the
page as it was before that step overwrites it, and a scatter lands before the step that reads it.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

KVPools = list[tuple[jax.Array, jax.Array]]


def copy_buckets(max_pages: int) -> list[int]:
    """Batch sizes the copies are padded to: 1, 2, 4, ... up to the first power of two >= max_pages."""
    sizes = [1]
    while sizes[-1] < max_pages:
        sizes.append(sizes[-1] * 2)
    return sizes


def _page_ids(pool: jax.Array, idx: jax.Array, num_pages: int) -> jax.Array:
    """i32[layers in the pool, n]: where pages `idx` of each layer sit in `pool`, which holds one layer
    [P, page, W] or, for the scanned layer loop, every layer stacked on the page axis [L * P, ...] (layer l's
    page p at l * P + p). Indices past the pool (padding) stay past it."""
    offsets = num_pages * jnp.arange(pool.shape[0] // num_pages, dtype=jnp.int32)[:, None]
    return jnp.where(idx[None, :] < num_pages, idx[None, :] + offsets, pool.shape[0])


def _gather(kv: KVPools, idx: jax.Array, num_pages: int) -> jax.Array:
    """[layers, 2, n, page, W]"""
    parts = []
    for k, v in kv:
        ids = _page_ids(k, idx, num_pages)
        parts.append(jnp.stack([k[ids], v[ids]], axis=1))
    return jnp.concatenate(parts)


def _scatter(kv: KVPools, idx: jax.Array, data: jax.Array, num_pages: int) -> KVPools:
    out, first = [], 0
    for k, v in kv:
        ids = _page_ids(k, idx, num_pages)
        part = data[first : first + ids.shape[0]]
        out.append((k.at[ids].set(part[:, 0].astype(k.dtype), mode="drop"),
                    v.at[ids].set(part[:, 1].astype(v.dtype), mode="drop")))  # fmt: skip
        first += ids.shape[0]
    return out


class PageCopier:
    """The gather and scatter programs for one runner's pools; `warmup` compiles every size."""

    def __init__(self, kv: KVPools, num_pages: int, max_pages: int, replicated, num_layers: int):
        self.num_pages = num_pages
        self.buckets = copy_buckets(max(1, min(max_pages, num_pages)))
        self._replicated = replicated
        shardings = [(k.sharding, v.sharding) for k, v in kv]
        self._gather = jax.jit(partial(_gather, num_pages=num_pages))
        self._scatter = jax.jit(partial(_scatter, num_pages=num_pages), donate_argnums=0, out_shardings=shardings)
        k = kv[0][0]
        self.block_shape = (num_layers, 2, *k.shape[1:])  # one page on the host: [layers, 2, page, W]
        self.dtype = k.dtype

    def _chunks(self, n: int) -> list[tuple[int, int, int]]:
        """(start, stop, bucket) pieces covering n pages, each at most the largest bucket."""
        out, start, top = [], 0, self.buckets[-1]
        while start < n:
            stop = min(n, start + top)
            out.append((start, stop, next(b for b in self.buckets if b >= stop - start)))
            start = stop
        return out

    def gather(self, kv: KVPools, pages: Sequence[int]) -> list[tuple[jax.Array, int]]:
        """Starts copying `pages` out; returns (device array, rows used) pieces, whose host copies are under way.
        Read them with `to_host`."""
        out = []
        for start, stop, b in self._chunks(len(pages)):
            idx = np.zeros(b, np.int32)
            idx[: stop - start] = pages[start:stop]
            arr = self._gather(kv, jax.device_put(idx, self._replicated))
            arr.copy_to_host_async()
            out.append((arr, stop - start))
        return out

    @staticmethod
    def to_host(pieces: list[tuple[jax.Array, int]]) -> list[np.ndarray]:
        """One host block [layers, 2, page, W] per gathered page, in order."""
        blocks = []
        for arr, n in pieces:
            host = np.asarray(arr)
            blocks += [np.ascontiguousarray(host[:, :, i]) for i in range(n)]
        return blocks

    def scatter(self, kv: KVPools, pages: Sequence[int], blocks: Sequence[np.ndarray]) -> KVPools:
        """Writes host blocks into `pages` of the (donated) pools; returns the new pools."""
        for start, stop, b in self._chunks(len(pages)):
            kv = self._scatter_padded(kv, pages[start:stop], blocks[start:stop], b)
        return kv

    def _scatter_padded(self, kv: KVPools, pages: Sequence[int], blocks: Sequence[np.ndarray], b: int) -> KVPools:
        idx = np.full(b, self.num_pages, np.int32)  # past the pool: dropped
        idx[: len(pages)] = pages
        data = np.zeros((self.block_shape[0], 2, b, *self.block_shape[2:]), self.dtype)
        for i, block in enumerate(blocks):
            data[:, :, i] = block
        return self._scatter(kv, jax.device_put(idx, self._replicated), jax.device_put(data, self._replicated))

    def warmup(self, kv: KVPools) -> KVPools:
        """Compiles every size of both programs (the warm-up scatters write nothing: every index is past the
        pool); returns the pools."""
        for b in self.buckets:
            self.to_host(self.gather(kv, [0] * b))
            kv = self._scatter_padded(kv, [], [], b)
        return kv
