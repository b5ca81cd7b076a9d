"""Host-side page bookkeeping: a pool of fixed-size KV pages with reference counts and a prefix cache.
Never imports jax.

Reference counts let several sequences share a page (a common prefix, or n > 1 samples of one prompt): a page is
released only when its last holder frees it. A released page that holds a full, hashed block of tokens is not
wiped: it waits in an LRU list, still findable by its hash, until a new allocation needs the space. So a later
request with the same prefix reuses it, and live pages (ref count > 0) are never evicted.

A block's hash chains the hash of the block before it with its own tokens, so a hit on block j means the whole
prefix up to j matches. The tokens are stored too and compared on a hit, so a hash collision cannot return
someone else's KV.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence


class OutOfPagesError(RuntimeError):
    """Not enough free pages; the scheduler preempts instead of failing the request."""


def block_hash(parent: int | None, tokens: Sequence[int]) -> int:
    return hash((parent, *tokens))


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_cache: bool = True):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"need num_pages >= 1 and page_size >= 1, got {num_pages}, {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_cache = enable_prefix_cache
        self._free: deque[int] = deque(range(num_pages))  # never hashed, or evicted
        self._evictable: OrderedDict[int, None] = OrderedDict()  # ref count 0 but hashed; oldest first
        self._refs = [0] * num_pages
        self._page_of: dict[int, int] = {}  # block hash -> page
        self._block_of: dict[int, tuple[int, tuple[int, ...]]] = {}  # page -> (hash, tokens)
        # Cached blocks whose pages were reused, as (page, hash, tokens), when someone wants them (a host tier
        # copies them out before the page is overwritten); None: not recorded.
        self.evicted: list[tuple[int, int, tuple[int, ...]]] | None = None
        # Prefix-cache statistics, in tokens.
        self.queried_tokens = 0
        self.hit_tokens = 0

    @property
    def num_free(self) -> int:
        """Pages an allocation can take now (free plus evictable)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_pages - self.num_free

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise OutOfPagesError(f"asked for {n} pages, {self.num_free} free of {self.num_pages}")
        pages = []
        for _ in range(n):
            if self._free:
                p = self._free.popleft()
            else:
                p, _ = self._evictable.popitem(last=False)  # least recently released cached block
                h, block = self._block_of.pop(p)
                del self._page_of[h]
                if self.evicted is not None:
                    self.evicted.append((p, h, block))
            self._refs[p] = 1
            pages.append(p)
        return pages

    def share(self, pages: Sequence[int]) -> None:
        """Another holder for pages that are already allocated."""
        for p in pages:
            if self._refs[p] <= 0:
                raise ValueError(f"page {p} is not allocated")
            self._refs[p] += 1

    def free(self, pages: Sequence[int]) -> None:
        for p in pages:
            if self._refs[p] <= 0:
                raise ValueError(f"page {p} freed more often than allocated")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                if p in self._block_of:
                    self._evictable[p] = None
                else:
                    self._free.append(p)

    def ref_count(self, page: int) -> int:
        return self._refs[page]

    # ------------------------------------------------------------------------------------------ prefix cache

    def match_prefix(self, tokens: Sequence[int], max_blocks: int) -> tuple[list[int], list[int]]:
        """Takes a reference on the cached pages holding the longest prefix of `tokens` in whole blocks (at
        most `max_blocks`). Returns (pages, their block hashes)."""
        pages: list[int] = []
        hashes: list[int] = []
        if not self.enable_prefix_cache:
            return pages, hashes
        ps, parent = self.page_size, None
        self.queried_tokens += max_blocks * ps
        for j in range(max_blocks):
            block = tuple(tokens[j * ps : (j + 1) * ps])
            h = block_hash(parent, block)
            p = self.take_cached(h, block)
            if p is None:
                break
            pages.append(p)
            hashes.append(h)
            parent = h
        self.hit_tokens += len(pages) * ps
        return pages, hashes

    def take_cached(self, h: int, block: tuple[int, ...]) -> int | None:
        """Takes a reference on the page caching `block` under hash `h`, if there is one."""
        p = self._page_of.get(h)
        if p is None or self._block_of[p][1] != block:
            return None
        if self._refs[p] == 0:
            del self._evictable[p]
        self._refs[p] += 1
        return p

    def forget(self, page: int) -> None:
        """Takes a held page out of the prefix cache: its holder is about to overwrite part of it."""
        if self._refs[page] <= 0:
            raise ValueError(f"page {page} is not allocated")
        entry = self._block_of.pop(page, None)
        if entry is not None:
            del self._page_of[entry[0]]

    def reset_prefix_cache(self) -> None:
        """Forgets every cached block (the KV they hold no longer fits the weights): released ones become free
        pages, held ones stay with their holders, uncached."""
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._page_of.clear()
        self._block_of.clear()

    def register(self, page: int, parent: int | None, tokens: Sequence[int]) -> int:
        """Records that `page` holds the full block `tokens` following block `parent`; returns its hash."""
        block = tuple(tokens)
        h = block_hash(parent, block)
        if self.enable_prefix_cache and h not in self._page_of and page not in self._block_of:
            self._page_of[h] = page
            self._block_of[page] = (h, block)
        return h
