"""Host-side page bookkeeping: a pool of fixed-size KV pages with reference counts. Never imports jax.

Reference counts let several sequences share a page (a common prefix, or n > 1 samples of one prompt): a page
returns to the free list only when its last holder frees it.
"""

from __future__ import annotations

from collections import deque


class OutOfPagesError(RuntimeError):
    """Not enough free pages; the scheduler preempts instead of failing the request."""


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"need num_pages >= 1 and page_size >= 1, got {num_pages}, {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free: deque[int] = deque(range(num_pages))
        self._refs = [0] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPagesError(f"asked for {n} pages, {len(self._free)} free of {self.num_pages}")
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def share(self, pages: list[int]) -> None:
        """Another holder for pages that are already allocated."""
        for p in pages:
            if self._refs[p] <= 0:
                raise ValueError(f"page {p} is not allocated")
            self._refs[p] += 1

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if self._refs[p] <= 0:
                raise ValueError(f"page {p} freed more often than allocated")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)

    def ref_count(self, page: int) -> int:
        return self._refs[page]
