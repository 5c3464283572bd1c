"""PageAllocator: KV page ids and their reference counts (no tensors: the storage lives in memory/kv.py's PagePool)."""
from __future__ import annotations

import heapq
from typing import Iterable, Sequence


class KVCacheFull(RuntimeError):
    """The page pool has too few free pages for a request (one-line message with the counts)."""


class PageAllocator:
    """Page ids 0..n_pages-1 with a reference count each.

    A page is free at count 0. ``alloc`` hands out free pages lowest id first (so a lone sequence gets one
    ascending run that attention reads without gathering) at count 1; ``ref`` adds a holder (a second sequence
    sharing a prefix, a checkpoint); ``unref`` drops one and frees the page when none is left. A page two holders
    share is referenced, never copied here: the page table that writes into a shared page copies it first
    (PagedKV.reserve, copy-on-write).
    """

    def __init__(self, n_pages: int, page_size: int):
        if page_size <= 0 or page_size & (page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {page_size}")
        if n_pages <= 0:
            raise ValueError(f"n_pages must be > 0, got {n_pages}")
        self.n_pages = int(n_pages)
        self.page_size = int(page_size)
        self._refs = [0] * self.n_pages
        self._free = list(range(self.n_pages))     # a min-heap of the pages at count 0
        heapq.heapify(self._free)

    @property
    def n_free(self) -> int:
        return len(self._free)

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def require(self, n: int) -> None:
        """KVCacheFull (one line, with the counts) unless n pages are free."""
        if n > len(self._free):
            raise KVCacheFull(f"KV cache full: need {n} more pages of {self.page_size} tokens, "
                              f"{len(self._free)} of {self.n_pages} free")

    def alloc(self, n: int) -> list[int]:
        """Take n free pages (lowest ids first, count 1). Raises KVCacheFull, taking none, when fewer are free."""
        self.require(n)
        out = [heapq.heappop(self._free) for _ in range(n)]
        for p in out:
            self._refs[p] = 1
        return out

    def ref(self, pages: Iterable[int]) -> None:
        """One more holder of each page (each must be held already). ValueError, changing nothing, otherwise."""
        pages = [int(p) for p in pages]
        bad = next((p for p in pages if not 0 <= p < self.n_pages or self._refs[p] == 0), None)
        if bad is not None:
            raise ValueError(f"page {bad} is not allocated: a free page cannot be shared")
        for p in pages:
            self._refs[p] += 1

    def unref(self, pages: Sequence[int]) -> None:
        """One holder fewer of each page; pages nobody holds go back to the free list."""
        for p in pages:
            p = int(p)
            if self._refs[p] <= 0:
                raise ValueError(f"page {p} is already free")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                heapq.heappush(self._free, p)
