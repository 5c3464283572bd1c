"""The KV cache on the device: CudaPagePool (f16 or q8_0 pages in the kernels' layout, one device page table) and
the check every plan makes before a step touches a sequence's pages."""
from __future__ import annotations

from typing import Any

import numpy as np

from strata.backend.cuda.library import check, ffi, lib, ptr, stream_ptr
from strata.backend.cuda.settings import KV_DTYPES
from strata.memory.kv import PagePool
from strata.memory.memory import host_copy


class CudaPagePool(PagePool):
    """A PagePool whose pages live on the device in the kernels' layout: per attention layer one K and one V array of
    shape (n_pages, page_size, n_kv_head, head_dim) (token t of page p, head h at [p, t, h]).

    kv "f16": the arrays are f16 (2 bytes per value). kv "q8_0" (``--kv q8_0``): the arrays are int8 and each layer
    also has f16 scale arrays (n_pages, page_size, n_kv_head, head_dim / 32), ``scales(slot)``: value = d * q per 32
    values of one (position, head) row, d = max|x| / 127 (ggml's q8_0 block; 1.0625 bytes per value).
    Same page accounting as PagePool (alloc / free / slot); ``write`` and ``read`` keep PagePool's contract
    (write f32 (n, n_kv_head, head_dim) at [start, start + n); read -> f32 copies (n_kv_head, length, head_dim),
    converted from the stored type), so SequenceState.hashes / nbytes and checkpoints work unchanged.
    ``table(pages)`` is the device page table (int32, one fixed buffer of n_pages entries that CUDA graphs read); it
    is rewritten only when the page list changes. Raises ValueError for another kv type, or q8_0 with a head_dim
    that is not a multiple of 32.
    """

    page_axis = 0

    def __init__(self, layers, n_pages: int, page_size: int, n_kv_head: int, head_dim: int, kv: str = "f16"):
        import cupy as cp
        if kv not in KV_DTYPES:
            raise ValueError(f"KV cache type {kv!r} is not one of {', '.join(KV_DTYPES)}")
        if kv == "q8_0" and head_dim not in (32, 64, 128, 256):
            raise ValueError(f"--kv q8_0 needs head_dim 32, 64, 128 or 256 (this model: {head_dim})")
        shape = (int(n_pages), int(page_size), int(n_kv_head), int(head_dim))
        dt = cp.int8 if kv == "q8_0" else cp.float16
        k = [cp.zeros(shape, dt) for _ in layers]
        v = [cp.zeros(shape, dt) for _ in layers]
        super().__init__(layers, n_pages, page_size, n_kv_head, head_dim, k, v, to_host=host_copy)
        self.kv = kv
        self.cp = cp
        if kv == "q8_0":
            sshape = shape[:3] + (int(head_dim) // 32,)
            self.ks = [cp.zeros(sshape, cp.float16) for _ in layers]
            self.vs = [cp.zeros(sshape, cp.float16) for _ in layers]
        else:
            self.ks = self.vs = None
        self._pt = cp.zeros(max(1, int(n_pages)), cp.int32)
        self._pt_key: tuple[int, ...] | None = None

    def scales(self, slot: int) -> tuple[Any, Any]:
        """The f16 scale arrays of layer slot `slot` (q8_0), or (None, None) for an f16 cache."""
        if self.ks is None:
            return None, None
        return self.ks[slot], self.vs[slot]

    @property
    def bytes_per_token(self) -> int:
        """Bytes of K+V one token takes over all attention layers (f16: 2 per value; q8_0: 1 + 2 / 32)."""
        vals = len(self.layers) * self.n_kv_head * (self.head_dim + self.head_dim_v)
        return vals * 2 if self.kv == "f16" else vals + vals // 16

    def table(self, pages) -> Any:
        """The device page table holding `pages` (int32, fixed address; entries past len(pages) are stale)."""
        key = tuple(int(p) for p in pages)
        if key != self._pt_key:
            if len(key) > self.n_pages:
                raise ValueError(f"page table of {len(key)} pages is longer than the pool ({self.n_pages})")
            if key:
                self._pt[:len(key)] = self.cp.asarray(np.asarray(key, dtype=np.int32))
            self._pt_key = key
        return self._pt

    def write(self, slot: int, pages, start: int, k: Any, v: Any) -> None:
        cp = self.cp
        k = cp.ascontiguousarray(cp.asarray(k, dtype=cp.float32))
        v = cp.ascontiguousarray(cp.asarray(v, dtype=cp.float32))
        n = int(k.shape[0])
        if k.shape != (n, self.n_kv_head, self.head_dim) or v.shape != k.shape:
            raise ValueError(f"KV write: k {tuple(k.shape)} / v {tuple(v.shape)} do not match "
                             f"(n, {self.n_kv_head}, {self.head_dim})")
        if start + n > len(pages) * self.page_size:
            raise ValueError(f"KV write at [{start}, {start + n}) past the pages given ({len(pages) * self.page_size})")
        pt = self.table(pages)
        row = self.n_kv_head * self.head_dim
        if self.kv == "q8_0":
            check(lib().strata_kv_write_q8(stream_ptr(), ptr(k), row, ptr(v), row, ptr(self.k[slot]),
                                           ptr(self.v[slot]), ptr(self.ks[slot]), ptr(self.vs[slot]), ptr(pt),
                                           ffi().NULL, int(start), n, self.n_kv_head, self.head_dim, self.page_size),
                  "strata_kv_write_q8")
            return
        check(lib().strata_kv_write(stream_ptr(), ptr(k), ptr(v), ptr(self.k[slot]), ptr(self.v[slot]), ptr(pt),
                                    ffi().NULL, int(start), n, self.n_kv_head, self.head_dim, self.page_size),
              "strata_kv_write")

    def read(self, slot: int, pages, length: int, contiguous: bool | None = None) -> tuple[Any, Any]:
        cp = self.cp
        ko = cp.empty((self.n_kv_head, int(length), self.head_dim), cp.float32)
        vo = cp.empty((self.n_kv_head, int(length), self.head_dim_v), cp.float32)
        if length > 0:
            if length > len(pages) * self.page_size:
                raise ValueError(f"KV read of {length} positions past the pages given ({len(pages) * self.page_size})")
            pt = self.table(pages)
            if self.kv == "q8_0":
                check(lib().strata_kv_gather_q8(stream_ptr(), ptr(self.k[slot]), ptr(self.v[slot]),
                                                ptr(self.ks[slot]), ptr(self.vs[slot]), ptr(pt), ptr(ko), ptr(vo),
                                                int(length), self.n_kv_head, self.head_dim, self.page_size),
                      "strata_kv_gather_q8")
            else:
                check(lib().strata_kv_gather(stream_ptr(), ptr(self.k[slot]), ptr(self.v[slot]), ptr(pt), ptr(ko),
                                             ptr(vo), int(length), self.n_kv_head, self.head_dim, self.page_size),
                      "strata_kv_gather")
        return ko, vo


def check_sequence(pool, state) -> None:
    """ValueError (one line) unless the sequence's KV pages are in `pool` and its KV length equals its position: what
    every plan checks before a step reads or writes the sequence."""
    kv = state.kv
    if kv.pool is not pool:
        raise ValueError("the sequence's KV pages are not in this plan's pool")
    if kv.length != state.pos:
        raise ValueError(f"KV length {kv.length} != sequence position {state.pos}")
