"""The host tier of the KV cache: prefix-cache blocks the device pool had to give up, kept in host memory (numpy)
under their block hash, so a later request copies them back instead of recomputing them. Never imports jax.

This is hierarchical KV caching (SGLang's HiCache, vLLM's KV offloading) at its simplest: the device prefix cache
is the first tier; when the allocator reuses a cached page (a released prefix page, or a session's page released
under memory pressure) the engine copies the page out first (`jaxinfer.engine.kv_copy`) and stores it here. A
prefix match that misses on the device goes on here, block by block; each hit gets a fresh device page and is
copied in before the step that reads it.

Blocks are stored with their tokens and compared on a hit, like the device prefix cache, so a hash collision
cannot return someone else's K/V. The tier has its own byte cap; the least recently used blocks go first.
A block's K/V is the same bits the device held, so outputs do not change with the tier on or off.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

# On GPU/TPU the host tier gets this much host memory per replica unless told otherwise. On CPU it is off by
# default: "host" memory is the device's own there, so a second tier would only hold the same bytes twice.
DEFAULT_HOST_BYTES = 2**30


def host_tier_bytes(configured: int | None, backend: str) -> int:
    """The host tier's byte cap: `configured` when given (0: off), else the backend's default."""
    if configured is not None:
        return configured
    return 0 if backend == "cpu" else DEFAULT_HOST_BYTES


class HostTier:
    def __init__(self, capacity_bytes: int, block_bytes: int):
        """`block_bytes`: the host bytes of one page (K and V of every layer)."""
        if block_bytes < 1:
            raise ValueError(f"block_bytes must be >= 1, got {block_bytes}")
        self.capacity_bytes = capacity_bytes
        self.block_bytes = block_bytes
        self.max_blocks = capacity_bytes // block_bytes
        self._blocks: OrderedDict[int, tuple[tuple[int, ...], np.ndarray]] = OrderedDict()  # oldest first
        # Counters for metrics and tests, in blocks (pages).
        self.hits = 0  # blocks copied back to the device
        self.spills = 0  # blocks copied in from the device
        self.evictions = 0  # blocks dropped for room

    @property
    def enabled(self) -> bool:
        return self.max_blocks > 0

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    @property
    def used_bytes(self) -> int:
        return len(self._blocks) * self.block_bytes

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._blocks

    def put(self, block_hash: int, tokens: Sequence[int], kv: np.ndarray) -> None:
        """Stores one block's K/V (replacing any block under the hash), making room from the oldest."""
        if not self.enabled:
            return
        self._blocks.pop(block_hash, None)
        while len(self._blocks) >= self.max_blocks:
            self._blocks.popitem(last=False)
            self.evictions += 1
        self._blocks[block_hash] = (tuple(tokens), kv)
        self.spills += 1

    def get(self, block_hash: int, tokens: Sequence[int]) -> np.ndarray | None:
        """The block's K/V when held under this hash with these very tokens (then it is the most recent)."""
        entry = self._blocks.get(block_hash)
        if entry is None or entry[0] != tuple(tokens):
            return None
        self._blocks.move_to_end(block_hash)
        self.hits += 1
        return entry[1]

    def clear(self) -> None:
        self._blocks.clear()
