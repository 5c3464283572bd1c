"""Host memory for state moved off the stages (parking, checkpoints kept apart, session files): an arena per kind of
memory (page-locked for CUDA stages, ordinary for CPU stages) that allocates in large chunks, hands out aligned
ranges as numpy arrays and takes a range back when its array is gone.

Getting fresh memory is the expensive part of copying state out: on the H200 host cudaHostAlloc took 0.3 s for 846
MiB where the device-to-host copy into it took 16 ms (session 15), and CuPy's pinned pool reuses a block only for the
same size, so a new chat at 64K tokens on the 1.5B hybrid spent 0.88 s parking the live conversation (62 ms with this
arena). On the CPU, fresh memory is paged in at ~0.6-1.3 GB/s while a copy into memory already touched runs at ~4-10
GB/s (this machine: 0.27 s against 0.046 s for a 7K-token conversation's 171 MB of K). An arena keeps what it
allocated (up to `keep_bytes`; fully free chunks beyond that go back) and serves every later copy from it, whatever
its size; `reserve` allocates ahead of the first park (the engine does it at start:
strata.cache.parked.ParkedConversations.prepin).
"""
from __future__ import annotations

import bisect
import ctypes
import threading
from typing import Callable

import numpy as np
import structlog

log = structlog.get_logger("strata.memory")

ALIGN = 4096                     # every range starts on a host page
CHUNK = 256 << 20                # the smallest pin; a larger request gets a chunk of its own size (rounded up)
RESERVE_STEP = 1 << 30           # the largest pin of a reserve (a refused one stops it where it is)


def _round(n: int, to: int) -> int:
    return (n + to - 1) // to * to


class _Chunk:
    """One pinned allocation: its base address, size and free ranges (sorted starts, sizes by start)."""

    __slots__ = ("ptr", "size", "starts", "sizes", "used")

    def __init__(self, ptr: int, size: int):
        self.ptr, self.size, self.used = ptr, size, 0
        self.starts, self.sizes = [0], {0: size}

    def take(self, n: int) -> int | None:
        """First fit: the offset of a free range of n bytes (n a multiple of ALIGN), or None."""
        for i, s in enumerate(self.starts):
            sz = self.sizes[s]
            if sz >= n:
                del self.sizes[s]
                if sz > n:
                    self.starts[i] = s + n          # the rest of the range stays where it was in the order
                    self.sizes[s + n] = sz - n
                else:
                    del self.starts[i]
                self.used += n
                return s
        return None

    def give(self, off: int, n: int) -> None:
        """Return [off, off + n), merged with free neighbours."""
        i = bisect.bisect_left(self.starts, off)
        if i < len(self.starts) and self.starts[i] < off + n or i > 0 and \
                self.starts[i - 1] + self.sizes[self.starts[i - 1]] > off:
            raise RuntimeError(f"pinned arena: range [{off}, {off + n}) freed twice")
        self.used -= n
        if i < len(self.starts) and self.starts[i] == off + n:           # merge the next free range
            n += self.sizes.pop(self.starts.pop(i))
        if i > 0 and self.starts[i - 1] + self.sizes[self.starts[i - 1]] == off:   # and the previous one
            self.sizes[self.starts[i - 1]] += n
            return
        self.starts.insert(i, off)
        self.sizes[off] = n


class _Lease:
    """Held by the array's buffer: hands its range back when the last view of the array is gone. The range goes to
    the arena's pending list (one atomic append), not through its lock: a finalizer may run inside the arena's own
    code on the same thread (a garbage collection there), where taking the lock again would deadlock."""

    __slots__ = ("arena", "chunk", "off", "n")

    def __init__(self, arena: "PinnedArena", chunk: _Chunk, off: int, n: int):
        self.arena, self.chunk, self.off, self.n = arena, chunk, off, n

    def __del__(self):
        self.arena._pending.append((self.chunk, self.off, self.n))


class PinnedArena:
    """Host memory in chunks from `pin(nbytes) -> address` (released with `unpin(address)`: cudaHostAlloc /
    cudaFreeHost, or ordinary memory for the CPU stages); `empty(shape, dtype)` is a C-contiguous numpy array in it.
    Thread-safe (arrays are freed by the garbage collector of any thread). When a pin fails (the host's locked-memory
    limit, or no memory), `empty` falls back to a plain numpy array."""

    def __init__(self, pin: Callable[[int], int], unpin: Callable[[int], None], keep_bytes: int = CHUNK):
        self._pin, self._unpin = pin, unpin
        self.keep_bytes = keep_bytes      # empty chunks are kept while at most this much is pinned
        self._chunks: list[_Chunk] = []
        self._lock = threading.Lock()
        self._pending: list[tuple[_Chunk, int, int]] = []   # ranges whose arrays are gone, not yet given back
        self._failed = False              # the last pin failed: no retry until a range came back
        self.pins = 0                     # chunks pinned so far (the costly calls)
        self.fallbacks = 0                # arrays served from ordinary memory because pinning failed

    @property
    def pinned_bytes(self) -> int:
        """Bytes pinned now (a read: ranges whose arrays are gone count until the next call settles them)."""
        with self._lock:
            return sum(c.size for c in self._chunks)

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return sum(c.used for c in self._chunks)

    def settle(self) -> None:
        """Give back the ranges whose arrays are gone (every allocation does this first)."""
        with self._lock:
            self._settle()

    def _settle(self) -> None:
        """Give the pending ranges back (the lock held); a chunk left empty goes back to the driver while more
        than keep_bytes are pinned."""
        while self._pending:
            chunk, off, n = self._pending.pop()
            chunk.give(off, n)
            self._failed = False          # memory came back: a pin may succeed again
            if chunk.used == 0 and sum(c.size for c in self._chunks) > self.keep_bytes:
                self._chunks.remove(chunk)
                self._unpin(chunk.ptr)

    def _grow(self, n: int) -> _Chunk | None:
        if self._failed:
            return None
        size = max(CHUNK, _round(n, ALIGN))
        try:
            ptr = self._pin(size)
        except Exception as e:        # CUDARuntimeError (out of pinnable memory) and the like
            log.warning("pinning host memory failed; parking uses ordinary memory until pinned memory is freed",
                        bytes=size, pinned=sum(c.size for c in self._chunks), error=str(e))
            self._failed = True
            return None
        c = _Chunk(ptr, size)
        self._chunks.append(c)
        self.pins += 1
        return c

    def _take(self, n: int) -> tuple[_Chunk, int] | None:
        with self._lock:
            self._settle()
            for c in self._chunks:
                off = c.take(n)
                if off is not None:
                    return c, off
            c = self._grow(n)
            if c is None:
                self.fallbacks += 1
                return None
            return c, c.take(n)

    def empty(self, shape, dtype) -> np.ndarray:
        """An uninitialized C-contiguous array of `shape` / `dtype` in pinned memory (ordinary memory if pinning
        failed)."""
        dtype = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        nbytes = max(count * dtype.itemsize, 1)
        span = _round(nbytes, ALIGN)
        got = self._take(span)
        if got is None:
            return np.empty(shape, dtype)
        chunk, off = got
        buf = (ctypes.c_ubyte * nbytes).from_address(chunk.ptr + off)
        buf._lease = _Lease(self, chunk, off, span)
        return np.frombuffer(buf, dtype, count).reshape(shape)

    def reserve(self, nbytes: int) -> None:
        """Pin ahead so that about `nbytes` are free in the arena (in pins of at most RESERVE_STEP, stopping at the
        first that fails, which is not held against later allocations), and keep at least what is pinned then."""
        with self._lock:
            self._settle()
            self._failed = False          # a reservation tries afresh
            free = sum(c.size - c.used for c in self._chunks)
            while free < nbytes:
                c = self._grow(min(nbytes - free, RESERVE_STEP))
                if c is None:
                    break
                free += c.size
            self._failed = False
            self.keep_bytes = max(self.keep_bytes, sum(c.size for c in self._chunks))


class _Ordinary:
    """Ordinary memory as an arena's `pin` / `unpin`: ctypes buffers, zero-filled (so paged in) when allocated."""

    def __init__(self):
        self.held: dict[int, ctypes.Array] = {}

    def pin(self, n: int) -> int:
        buf = (ctypes.c_ubyte * n)()
        self.held[ctypes.addressof(buf)] = buf
        return ctypes.addressof(buf)

    def unpin(self, ptr: int) -> None:
        del self.held[ptr]


_arenas: dict[str, PinnedArena] = {}
_arenas_lock = threading.Lock()


def arena(kind: str = "cuda") -> PinnedArena:
    """The process's arena of `kind`: "cuda", CUDA's page-locked allocations (cudaHostAlloc, portable: any device
    may copy); "cpu", ordinary memory kept paged in."""
    with _arenas_lock:
        if kind not in _arenas:
            if kind == "cuda":
                import cupy
                rt = cupy.cuda.runtime
                _arenas[kind] = PinnedArena(lambda n: rt.hostAlloc(n, rt.hostAllocPortable), rt.freeHost)
            elif kind == "cpu":
                mem = _Ordinary()
                _arenas[kind] = PinnedArena(mem.pin, mem.unpin)
            else:
                raise ValueError(f"unknown host memory kind {kind!r} (expected 'cuda' or 'cpu')")
        return _arenas[kind]


def pinned_bytes() -> int:
    """Bytes the process holds pinned for CUDA stages (0 before anything was pinned)."""
    a = _arenas.get("cuda")
    return a.pinned_bytes if a is not None else 0


def host_bytes() -> int:
    """Bytes the process holds in its CPU stages' arena (0 before anything was allocated)."""
    a = _arenas.get("cpu")
    return a.pinned_bytes if a is not None else 0
