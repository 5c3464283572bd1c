"""KVMemory: a stage's attention K/V (or the MTP drafter's) in pages of a PagePool, behind the Memory interface."""
from __future__ import annotations

import numpy as np

from strata.memory.host import sha_arrays
from strata.memory.kv import KVCacheFull, PagedKV, PagePool
from strata.memory.memory import Field, Memory
from strata.memory.part import Carve, KVPages, PartMismatch
from strata.memory.sequence_state import SequenceState


class KVMemory(Memory, Field):
    """Attention K/V in pages of `pool` (the carve's attention layers). `name` is the field: "kv" (the sequence's
    page table, length == pos) or "draft" (the MTP drafter's, length <= pos). backend: see Memory."""

    def __init__(self, carve: Carve, pool: PagePool, name: str = "kv", identity: dict | None = None,
                 backend=None):
        super().__init__(carve, identity, backend)
        bad = [li for li in pool.layers if li not in carve and name == "kv"]
        if bad:
            raise ValueError(f"KV layers {bad} are outside the carve {carve}")
        self.pool = pool
        self.name = name

    def table(self, st: SequenceState) -> PagedKV:
        return getattr(st, self.name)

    def _cuts_anywhere(self):
        return True

    def _open(self, st):
        setattr(st, self.name, PagedKV(self.pool))

    def _close(self, st):
        self.table(st).release()

    def _check_truncate(self, st, p):
        pass

    def _truncate(self, st, p):
        t = self.table(st)
        t.truncate(min(p, t.length))

    def _reset(self, st):
        self.table(st).truncate(0)

    def _geometry(self, g):
        pool = self.pool
        g[self.name] = {"layers": list(pool.layers), "page_size": pool.page_size,
                        "arrays": {n: [list(s), d.str] for n, (s, d) in pool.page_arrays().items()}}

    def _pages_for(self, length: int) -> int:
        return -(-int(length) // self.pool.page_size)

    def _capture(self, st, part):
        t = self.table(st)
        part.kv[self.name] = KVPages(length=t.length, hold=self.pool.hold(t.pages[:self._pages_for(t.length)],
                                                                          t.length))

    def _capture_at(self, st, part, p):
        t = self.table(st)
        n = min(int(p), t.length)          # the K/V of [0, p) (a drafter's lags its sequence: what it has of them)
        part.kv[self.name] = KVPages(length=n, hold=self.pool.hold(t.pages[:self._pages_for(n)], n))

    def _check(self, part, st):
        kvp = part.kv.get(self.name)
        if kvp is None:
            raise PartMismatch(f"the part has no {self.name!r} K/V, stage {self.carve} keeps it")
        if self.name == "kv" and kvp.length != part.pos:
            raise PartMismatch(f"the part's K/V length {kvp.length} != its position {part.pos}")
        if not 0 <= kvp.length <= part.pos or kvp.length > self.pool.capacity_tokens:
            raise PartMismatch(f"the part's {self.name} K/V length {kvp.length} does not fit "
                               f"(position {part.pos}, pool of {self.pool.capacity_tokens} tokens)")
        m = self._pages_for(kvp.length)
        if kvp.is_prefix:
            return
        if kvp.is_held:
            h = kvp.hold
            if h.released or h.pool is not self.pool or h.length != kvp.length or len(h.pages) != m:
                raise PartMismatch(f"the part's held {self.name} pages were given back or are of another pool")
            return
        want = {n: (tuple(s), d) for n, (s, d) in self.pool.page_arrays().items()}
        if set(kvp.arrays) != set(want):
            raise PartMismatch(f"the part's {self.name} arrays {sorted(kvp.arrays)} differ from the stage's")
        for n, (shape, dt) in want.items():
            a = kvp.arrays[n]
            exp = self.pool.row_shape(shape, kvp.length)
            if tuple(a.shape) != exp or np.dtype(a.dtype) != dt:
                raise PartMismatch(f"the part's {self.name} array {n} is {tuple(a.shape)} {np.dtype(a.dtype)}, "
                                   f"expected {exp} {dt}")
        if st is not None:
            a = self.pool.allocator
            t = self.table(st)
            free = self.pool.n_free + sum(1 for p in t.pages if a.refcount(p) == 1)
            if m > free:
                raise KVCacheFull(f"KV cache full: restoring {kvp.length} {self.name} positions needs {m} pages, "
                                   f"{free} can be freed")

    def _restore(self, st, part):
        kvp = part.kv[self.name]
        t = self.table(st)
        if kvp.is_held:
            t.adopt(kvp.hold)                    # the held pages become the sequence's too: nothing is copied
            return
        t.release()
        m = self._pages_for(kvp.length)
        t.reserve(kvp.length)                    # pages for [0, length); checked free above
        self.pool.import_rows(t.pages[:m], kvp.length, kvp.arrays)
        t.commit(kvp.length)

    def _attach(self, st, part, out):
        kvp, t = part.kv[self.name], self.table(st)
        if t.length < kvp.length:
            raise PartMismatch(f"the checkpoint's {self.name} K/V covers {kvp.length} positions, the sequence holds "
                               f"{t.length}")
        out.kv[self.name] = KVPages(length=kvp.length, hold=self.pool.hold(t.pages[:self._pages_for(kvp.length)],
                                                                            kvp.length))

    def _join(self, part, whole, out, copy):
        kvp, w = part.kv[self.name], whole.kv.get(self.name)
        if not kvp.is_prefix:
            raise PartMismatch(f"the checkpoint part's {self.name} K/V is not a prefix: nothing to join")
        if w is None or w.arrays is None or w.length < kvp.length:
            raise PartMismatch(f"the conversation's {self.name} K/V is not host copies of at least {kvp.length} "
                               "positions")
        cut = (slice(None),) * self.pool.page_axis + (slice(0, kvp.length),)
        out.kv[self.name] = KVPages(length=kvp.length, arrays={k: (np.array(a[cut]) if copy else a[cut])
                                                               for k, a in w.arrays.items()})

    def _materialize(self, part, out):
        kvp = part.kv[self.name]
        if kvp.is_prefix:
            out.kv[self.name] = KVPages(length=kvp.length)
        elif kvp.is_held:
            out.kv[self.name] = KVPages(length=kvp.length, arrays=self.pool.export_rows(kvp.hold.pages, kvp.length))
        else:
            out.kv[self.name] = KVPages(length=kvp.length, arrays={k: np.array(a) for k, a in kvp.arrays.items()})

    def _expect(self, pos, lengths, out, prefix=(), rows=None):
        length = lengths.get(self.name)
        if length is None:
            raise PartMismatch(f"the part has no {self.name!r} K/V, stage {self.carve} keeps it")
        if not 0 <= length <= pos or (self.name == "kv" and length != pos) or length > self.pool.capacity_tokens:
            raise PartMismatch(f"the part's {self.name} K/V length {length} does not fit (position {pos}, "
                               f"pool of {self.pool.capacity_tokens} tokens)")
        if self.name in prefix:
            return
        m = self._pages_for(length)
        ax = self.pool.page_axis
        for n, (shape, dt) in sorted(self.pool.page_arrays().items()):
            if rows is None or self.name in rows:        # the used rows only (row_shape)
                out.append((f"{self.name}.{n}", self.pool.row_shape(shape, length), dt))
            else:                                        # an older writer's whole pages
                out.append((f"{self.name}.{n}", shape[:ax] + (m,) + shape[ax + 1:], dt))

    def _upgrade(self, part, rows):
        kvp = part.kv.get(self.name)
        if kvp is not None and kvp.arrays is not None and self.name not in rows:
            kvp.arrays = self.pool.pages_to_rows(kvp.arrays, kvp.length)

    def _hashes(self, st, out):
        t = self.table(st)
        for slot, layer in enumerate(self.pool.layers):
            k, v = t.read(slot, t.length)
            out[f"{self.name}.L{layer}"] = sha_arrays(k, v)

    def _nbytes(self, st):
        return self.table(st).nbytes()

    def _stats(self, out):
        pool = self.pool
        out[self.name] = {"pages_used": pool.n_pages - pool.n_free, "pages_total": pool.n_pages,
                          "pages_held": pool.held_pages(),
                          "page_size": pool.page_size, "layers": len(pool.layers),
                          "bytes": pool.capacity_tokens * pool.bytes_per_token}

