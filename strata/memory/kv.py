"""The paged KV cache: PagePool (K/V storage of fixed-size pages per attention layer, over a PageAllocator) and
PagedKV (a sequence's page table, copy-on-write over shared pages)."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from strata.memory.pages import KVCacheFull, PageAllocator
from strata.memory.host import host_copy
from strata.memory.pinned import arena as host_arena

DEFAULT_PAGE_SIZE = 256

__all__ = ["DEFAULT_PAGE_SIZE", "Hold", "KVCacheFull", "PagePool", "PagedKV"]


class Hold:
    """Pages of a pool held by something other than a sequence's page table (a checkpoint, a conversation parked
    resident on its device): one reference on each page, so the K/V of [0, length) stays while the live sequence
    reads on over other pages.
    A sequence that writes into a page it shares with a hold keeps the page and the hold gets a copy
    (PagePool.rehome): the live page table never changes under the checkpoints that reference it. ``release``
    gives the references back (idempotent)."""

    def __init__(self, pool: "PagePool", pages: Sequence[int], length: int):
        self.pool = pool
        self.pages = [int(p) for p in pages]
        self.length = int(length)
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.pool._drop_hold(self)


class PagePool:
    """Fixed-size pages of K and V for the attention layers of one model on one backend.

    Storage per attention layer slot s: ``k[s]`` and ``v[s]`` of shape (n_kv_head, n_pages, page_size, head_dim),
    float32 (numpy on CPU, CuPy on GPU; allocated by ``Backend.new_page_pool``). Token t of a sequence lives in
    page ``pages[t // page_size]`` at offset ``t % page_size``. ``layers`` lists the model's layer indices that
    have attention (all of them for llama; every few for hybrid models); ``slot(layer)`` maps one to its storage.
    Page ids and reference counts are the ``alloc`` PageAllocator's (lowest id first, so a lone sequence gets one
    contiguous run and attention can read it without gathering). ``page_axis`` is the axis of the storage arrays
    that indexes pages (1 here; a backend's own layout may differ); ``storage(slot)`` names every array a page has
    a slice of, which is what ``copy_page``, ``export_pages`` and ``import_pages`` move.
    """

    page_axis = 1

    def __init__(self, layers: Sequence[int], n_pages: int, page_size: int, n_kv_head: int, head_dim: int,
                 k: list, v: list, to_host: Callable[[Any], np.ndarray] = np.asarray, head_dim_v: int | None = None):
        self.allocator = PageAllocator(n_pages, page_size)       # checks page_size and n_pages
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
        self._holds: list[Hold] = []

    @property
    def n_free(self) -> int:
        return self.allocator.n_free

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
        return self.allocator.alloc(n)

    def free(self, pages: Sequence[int]) -> None:
        """Drop one reference to each page (a page nobody holds any more is free again)."""
        self.allocator.unref(pages)

    # --- holds: pages kept for a conversation parked on the device -------------------------------
    def hold(self, pages: Sequence[int], length: int) -> Hold:
        """A Hold of `pages` (each allocated; one more reference each) for K/V of [0, length)."""
        if len(pages) != -(-int(length) // self.page_size):
            raise ValueError(f"a hold of {length} positions needs {-(-int(length) // self.page_size)} pages, "
                             f"got {len(pages)}")
        h = Hold(self, pages, length)
        self.allocator.ref(h.pages)                  # ValueError, holding nothing, for a free page
        self._holds.append(h)
        return h

    @property
    def holds(self) -> list[Hold]:
        """The holds not yet released."""
        return list(self._holds)

    def held_pages(self) -> int:
        """Pages some hold references (counted once)."""
        return len({p for h in self.holds for p in h.pages})

    def _drop_hold(self, h: Hold) -> None:
        self._holds.remove(h)
        self.allocator.unref(h.pages)
        h.pages = []

    def holds_below(self, page: int, offset: int) -> int:
        """How many of the references to `page` are holds whose positions on it all lie before `offset` (a write
        from `offset` on leaves what they hold as it is)."""
        if offset <= 0 or not self._holds:
            return 0
        ps = self.page_size
        return sum(1 for h in self._holds for j, p in enumerate(h.pages) if p == page and h.length - j * ps <= offset)

    def holds_of(self, page: int) -> int:
        """How many of the references to `page` are holds."""
        return sum(1 for h in self._holds for p in h.pages if p == page) if self._holds else 0

    def rehome(self, page: int, offset: int = 0) -> bool:
        """Give the holds of `page` that read at or past `offset` on it a copy of it on a fresh page (one copy,
        their references moved to it), so the sequence writing into `page` from `offset` on keeps it, and so do the
        holds whose positions on it all lie before `offset`. False when no hold reads there; KVCacheFull (nothing
        changed) when no page is free."""
        ps = self.page_size
        holders = [(h, i) for h in self.holds for i, p in enumerate(h.pages)
                   if p == page and h.length - i * ps > offset]
        if not holders:
            return False
        (q,) = self.alloc(1)
        self.copy_page(page, q)
        if len(holders) > 1:
            self.allocator.ref([q] * (len(holders) - 1))
        for h, i in holders:
            h.pages[i] = q
        self.allocator.unref([page] * len(holders))
        return True

    # --- raw page storage (copy-on-write, byte parts) --------------------------------------------
    def storage(self, slot: int) -> dict[str, Any]:
        """The storage arrays of layer slot `slot` by name: "k", "v" (and "k_scale", "v_scale" where the cache
        keeps scales). Every array has the page axis ``page_axis``."""
        out = {"k": self.k[slot], "v": self.v[slot]}
        ks = getattr(self, "ks", None)
        if ks is not None:
            out["k_scale"], out["v_scale"] = ks[slot], self.vs[slot]
        return out

    def _at(self, pages) -> tuple:
        """The index of `pages` along the page axis: a slice when they are one ascending run (a plain strided copy,
        not a gather), else the list."""
        if isinstance(pages, list) and pages and _is_run(pages):
            pages = slice(pages[0], pages[0] + len(pages))
        return (slice(None),) * self.page_axis + (pages,)

    def copy_page(self, src: int, dst: int) -> None:
        """Copy page `src` into page `dst` in every layer (the copy in copy-on-write)."""
        for slot in range(len(self.layers)):
            for a in self.storage(slot).values():
                a[self._at(dst)] = a[self._at(src)]

    @property
    def row_axis(self) -> int:
        """The axis of a storage array that indexes positions within a page (the one after ``page_axis``)."""
        return self.page_axis + 1

    def row_shape(self, page_shape: Sequence[int], length: int) -> tuple[int, ...]:
        """The shape of ``length`` positions of an array whose one-page slice is `page_shape` (page_arrays): the
        page and row axes merged into one axis of ``length`` positions (the row form export_rows gives)."""
        ax = self.page_axis
        return tuple(page_shape[:ax]) + (int(length),) + tuple(page_shape[ax + 2:])

    def pages_to_rows(self, arrays: dict[str, Any], length: int) -> dict[str, Any]:
        """Arrays of whole pages (the page axis, then a page's rows) as the row form of [0, length): views where
        the layout allows (the page and row axes merged, then cut at ``length``)."""
        ax = self.page_axis
        out = {}
        for key, a in arrays.items():
            shape = tuple(a.shape)
            merged = a.reshape(shape[:ax] + (shape[ax] * shape[ax + 1],) + shape[ax + 2:])
            out[key] = merged[(slice(None),) * ax + (slice(0, int(length)),)]
        return out

    def export_rows(self, pages: Sequence[int], length: int) -> dict[str, np.ndarray]:
        """Host copies of positions [0, length) held in `pages` (ceil(length / page_size) of them, in order), in
        every layer: "L{layer}.{name}" -> an array whose page and row axes are merged into one axis of ``length``
        positions (row_shape): the used rows only, so a short conversation costs its tokens, not whole pages."""
        idx = [int(p) for p in pages]
        length = int(length)
        ps, ax = self.page_size, self.page_axis
        if len(idx) != -(-length // ps):
            raise ValueError(f"{length} positions are held in {-(-length // ps)} pages, got {len(idx)}")
        out = {}
        for slot, layer in enumerate(self.layers):
            for name, a in self.storage(slot).items():
                at = self._at(idx)
                key = f"L{layer}.{name}"
                if not idx:
                    shape = list(a.shape)
                    out[key] = np.zeros(self.row_shape(shape[:ax] + [1] + shape[ax + 1:], 0), np.dtype(a.dtype))
                elif not isinstance(a, np.ndarray) or isinstance(at[ax], slice):
                    # a device array (to_host copies only the rows: pinned host memory on CUDA), or one run of
                    # pages: the page and row axes merge into a view, cut at length, one copy into the host arena
                    view = self.pages_to_rows({key: a[at]}, length)[key]
                    out[key] = self.to_host(view) if not isinstance(a, np.ndarray) else host_copy(view)
                else:                              # scattered pages: each page's used rows into the host arena
                    shape = list(a.shape)
                    rows = host_arena("cpu").empty(self.row_shape(shape[:ax] + [1] + shape[ax + 1:], length),
                                                   a.dtype)
                    for j, p in enumerate(idx):
                        n = min(ps, length - j * ps)
                        rows[(slice(None),) * ax + (slice(j * ps, j * ps + n),)] = \
                            a[(slice(None),) * ax + (p, slice(0, n))]
                    out[key] = rows
        return out

    def page_arrays(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """Per exported name: the shape of ONE page's slice (the page axis of length 1) and the dtype."""
        out = {}
        for slot, layer in enumerate(self.layers):
            for name, a in self.storage(slot).items():
                shape = list(a.shape)
                shape[self.page_axis] = 1
                out[f"L{layer}.{name}"] = (tuple(shape), np.dtype(a.dtype))
        return out

    def import_rows(self, pages: Sequence[int], length: int, arrays: dict[str, Any]) -> None:
        """Write `arrays` (the row form export_rows gives, of [0, length)) into `pages` (ceil(length / page_size)
        of them): whole pages at once, the last one's used rows apart (its rows past ``length`` are left as they
        are: nothing reads past a sequence's length)."""
        idx = [int(p) for p in pages]
        length = int(length)
        ps, ax = self.page_size, self.page_axis
        full, r = divmod(length, ps)
        lead = (slice(None),) * ax
        for slot, layer in enumerate(self.layers):
            for name, a in self.storage(slot).items():
                src = arrays[f"L{layer}.{name}"]
                if not isinstance(a, np.ndarray):          # device storage: one host-to-device copy
                    import cupy
                    src = cupy.asarray(src)
                if full:
                    body = src[lead + (slice(0, full * ps),)]
                    shape = tuple(body.shape)
                    a[self._at(idx[:full])] = body.reshape(shape[:ax] + (full, ps) + shape[ax + 1:])
                if r:
                    a[lead + (idx[full], slice(0, r))] = src[lead + (slice(full * ps, length),)]

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
        """Make sure pages cover [0, length + n) and that the pages [length, length + n) will be written into are
        this table's alone (a page another holder shares is copied to a fresh page first: copy-on-write). Raises
        KVCacheFull (holding nothing new, changing nothing) when the pool is short."""
        ps = self.pool.page_size
        alloc = self.pool.allocator
        end = -(-(self.length + n) // ps)
        first = self.length // ps
        # a page another holder shares is copied before a write into it, unless every other holder is a hold whose
        # positions on that page all lie before the write's first one (it never reads what this table writes there)
        def must_copy(i: int) -> bool:
            return alloc.refcount(self.pages[i]) - 1 > self.pool.holds_below(self.pages[i], self.length - i * ps)
        shared = [i for i in range(first, min(end, len(self.pages))) if must_copy(i)]
        need = end - len(self.pages)
        rehome = [i for i in shared if self.pool.holds_below(self.pages[i], self.length - i * ps)
                  < self.pool.holds_of(self.pages[i])]
        if rehome:
            alloc.require(max(0, need) + len(shared))    # before any copy: KVCacheFull changes nothing
            for i in rehome:                  # a page a hold reads past the write's start: it gets the copy
                self.pool.rehome(self.pages[i], self.length - i * ps)
            shared = [i for i in shared if must_copy(i)]          # other sequences share it: this table copies
        new = self.pool.alloc(max(0, need) + len(shared))      # KVCacheFull here takes nothing
        for i, p in zip(shared, new[len(new) - len(shared):]):
            self.pool.copy_page(self.pages[i], p)
            alloc.unref([self.pages[i]])
            self.pages[i] = p
        if need > 0:
            self.pages.extend(new[:need])
        if new:
            self._contig = _is_run(self.pages)

    def share(self, other: "PagedKV", length: int) -> None:
        """Hold `other`'s pages covering [0, length) as this table's prefix (referenced, not copied); this table's
        own pages are given back first. Writes past `length` copy a shared last page first (reserve)."""
        if other.pool is not self.pool:
            raise ValueError("cannot share pages across page pools")
        if not 0 <= length <= other.length:
            raise ValueError(f"share({length}) outside [0, {other.length}]")
        m = -(-int(length) // self.pool.page_size)
        pages = list(other.pages[:m])
        self.pool.allocator.ref(pages)
        self.release()
        self.pages = pages
        self.length = int(length)
        self._contig = _is_run(self.pages)

    def commit(self, n: int) -> None:
        """Mark n more positions valid (after all layers wrote them)."""
        if self.length + n > self.capacity:
            raise ValueError(f"commit({n}) past the reserved pages ({self.length} + {n} > {self.capacity})")
        self.length += n

    def truncate(self, p: int) -> None:
        """Cut the valid length back to p (0 <= p <= length); pages are kept for reuse, but not those past the cut
        that another holder shares (a parked conversation's: writing there would copy them)."""
        if not 0 <= p <= self.length:
            raise ValueError(f"truncate({p}) outside [0, {self.length}]")
        self.length = int(p)
        keep = -(-self.length // self.pool.page_size)
        alloc = self.pool.allocator
        if any(alloc.refcount(q) > 1 for q in self.pages[keep:]):
            self.trim()

    def adopt(self, hold: Hold) -> None:
        """Make the pages of `hold` this table's (one more reference each; the hold keeps its own), valid length
        the hold's; this table's own pages are given back first."""
        if hold.pool is not self.pool or hold.released:
            raise ValueError("the hold is released or of another page pool")
        pages = list(hold.pages)
        self.pool.allocator.ref(pages)
        self.release()
        self.pages = pages
        self.length = hold.length
        self._contig = _is_run(self.pages)

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
