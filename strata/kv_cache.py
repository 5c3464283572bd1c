"""The paged KV cache: PagePool (fixed-size pages of K/V per attention layer) and PagedKV (a sequence's page table)."""
from __future__ import annotations

import heapq
from typing import Any, Callable, Sequence

import numpy as np

DEFAULT_PAGE_SIZE = 256


class KVCacheFull(RuntimeError):
    """The page pool has too few free pages for a request (one-line message with the counts)."""


class PagePool:
    """Fixed-size pages of K and V for the attention layers of one model on one backend.

    Storage per attention layer slot s: ``k[s]`` and ``v[s]`` of shape (n_kv_head, n_pages, page_size, head_dim),
    float32 (numpy on CPU, CuPy on GPU; allocated by ``Backend.new_page_pool``). Token t of a sequence lives in
    page ``pages[t // page_size]`` at offset ``t % page_size``. ``layers`` lists the model's layer indices that
    have attention (all of them for llama; every few for hybrid models); ``slot(layer)`` maps one to its storage.
    Free pages are handed out lowest id first, so a lone sequence gets one contiguous run and attention can read
    it without gathering.
    """

    def __init__(self, layers: Sequence[int], n_pages: int, page_size: int, n_kv_head: int, head_dim: int,
                 k: list, v: list, to_host: Callable[[Any], np.ndarray] = np.asarray, head_dim_v: int | None = None):
        if page_size <= 0 or page_size & (page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {page_size}")
        if n_pages <= 0:
            raise ValueError(f"n_pages must be > 0, got {n_pages}")
        self.layers = tuple(int(x) for x in layers)
        self._slot = {layer: i for i, layer in enumerate(self.layers)}
        self.n_pages = int(n_pages)
        self.page_size = int(page_size)
        self.n_kv_head = int(n_kv_head)
        self.head_dim = int(head_dim)
        self.head_dim_v = int(head_dim_v or head_dim)
        self.k = k
        self.v = v
        self.to_host = to_host
        self._free = list(range(self.n_pages))  # a min-heap
        heapq.heapify(self._free)

    @property
    def n_free(self) -> int:
        return len(self._free)

    @property
    def capacity_tokens(self) -> int:
        return self.n_pages * self.page_size

    @property
    def bytes_per_token(self) -> int:
        """Bytes of K+V one token takes over all attention layers (float32)."""
        return len(self.layers) * self.n_kv_head * (self.head_dim + self.head_dim_v) * 4

    def slot(self, layer: int) -> int:
        """Storage slot of model layer `layer`; KeyError if that layer has no attention."""
        try:
            return self._slot[layer]
        except KeyError:
            raise KeyError(f"layer {layer} has no KV pages (attention layers: {list(self.layers)})") from None

    def alloc(self, n: int) -> list[int]:
        """Take n free pages (lowest ids first). Raises KVCacheFull, taking none, when fewer are free."""
        if n > len(self._free):
            raise KVCacheFull(f"KV cache full: need {n} more pages of {self.page_size} tokens, "
                              f"{len(self._free)} of {self.n_pages} free")
        return [heapq.heappop(self._free) for _ in range(n)]

    def free(self, pages: Sequence[int]) -> None:
        """Return pages to the pool."""
        for p in pages:
            heapq.heappush(self._free, int(p))

    # --- K/V access used by backends -------------------------------------------------------------
    def write(self, slot: int, pages: Sequence[int], start: int, k: Any, v: Any) -> None:
        """Store k (n, n_kv_head, head_dim) and v (n, n_kv_head, head_dim_v) at positions [start, start + n)."""
        n = k.shape[0]
        ps = self.page_size
        kt = k.transpose(1, 0, 2)
        vt = v.transpose(1, 0, 2)
        K, V = self.k[slot], self.v[slot]
        pos = start
        while pos < start + n:
            page = pages[pos // ps]
            off = pos % ps
            c = min(ps - off, start + n - pos)
            a = pos - start
            K[:, page, off:off + c] = kt[:, a:a + c]
            V[:, page, off:off + c] = vt[:, a:a + c]
            pos += c

    def read(self, slot: int, pages: Sequence[int], length: int, contiguous: bool | None = None) -> tuple[Any, Any]:
        """K and V of positions [0, length): (n_kv_head, length, head_dim). A view when the pages are one
        ascending run, else a gathered copy."""
        ps = self.page_size
        m = -(-length // ps)
        K, V = self.k[slot], self.v[slot]
        if m == 0:
            return K[:, :0, :0].reshape(self.n_kv_head, 0, self.head_dim), \
                V[:, :0, :0].reshape(self.n_kv_head, 0, self.head_dim_v)
        if contiguous is None:
            contiguous = _is_run(pages[:m])
        if contiguous:
            a = pages[0]
            ks = K[:, a:a + m]
            vs = V[:, a:a + m]
        else:
            idx = list(pages[:m])
            ks = K[:, idx]
            vs = V[:, idx]
        ks = ks.reshape(self.n_kv_head, m * ps, self.head_dim)[:, :length]
        vs = vs.reshape(self.n_kv_head, m * ps, self.head_dim_v)[:, :length]
        return ks, vs


def _is_run(pages: Sequence[int]) -> bool:
    return all(pages[i] == pages[0] + i for i in range(1, len(pages)))


class PagedKV:
    """One sequence's page table over a PagePool.

    ``length`` is the number of positions whose K/V are valid. A forward pass calls ``reserve(n)`` (pages for
    [length, length + n)), lets every attention layer write and attend at ``length``, then ``commit(n)``.
    ``truncate(p)`` cuts the valid length back and keeps the pages; ``trim()`` returns pages beyond the length;
    ``release()`` returns all pages.
    """

    def __init__(self, pool: PagePool):
        self.pool = pool
        self.pages: list[int] = []
        self.length = 0
        self._contig = True

    @property
    def capacity(self) -> int:
        """Positions the held pages cover."""
        return len(self.pages) * self.pool.page_size

    @property
    def contiguous(self) -> bool:
        """True when the held pages are one ascending run (attention reads them without a gather)."""
        return self._contig

    def reserve(self, n: int) -> None:
        """Make sure pages cover [0, length + n). Raises KVCacheFull (holding nothing new) when the pool is short."""
        need = -(-(self.length + n) // self.pool.page_size) - len(self.pages)
        if need > 0:
            new = self.pool.alloc(need)
            self.pages.extend(new)
            self._contig = _is_run(self.pages)

    def commit(self, n: int) -> None:
        """Mark n more positions valid (after all layers wrote them)."""
        if self.length + n > self.capacity:
            raise ValueError(f"commit({n}) past the reserved pages ({self.length} + {n} > {self.capacity})")
        self.length += n

    def truncate(self, p: int) -> None:
        """Cut the valid length back to p (0 <= p <= length); pages are kept for reuse."""
        if not 0 <= p <= self.length:
            raise ValueError(f"truncate({p}) outside [0, {self.length}]")
        self.length = int(p)

    def trim(self) -> None:
        """Return pages past the valid length to the pool."""
        keep = -(-self.length // self.pool.page_size)
        if keep < len(self.pages):
            self.pool.free(self.pages[keep:])
            del self.pages[keep:]
            self._contig = _is_run(self.pages)

    def release(self) -> None:
        """Return every page to the pool; length becomes 0."""
        self.pool.free(self.pages)
        self.pages = []
        self.length = 0
        self._contig = True

    def read(self, slot: int, length: int | None = None) -> tuple[Any, Any]:
        """K, V of [0, length or self.length) for storage slot `slot`: (n_kv_head, length, head_dim)."""
        return self.pool.read(slot, self.pages, self.length if length is None else length, self._contig)

    def nbytes(self) -> int:
        """Bytes of K/V the valid positions hold."""
        return self.length * self.pool.bytes_per_token
