"""strata.memory.pinned: the arena of page-locked host memory for parked state, over ordinary memory here (the
allocator is the same code that runs over cudaHostAlloc on a GPU host)."""
from __future__ import annotations

import ctypes
import gc

import numpy as np
import pytest
from hypothesis import given, settings, strategies as hs

from strata.memory import pinned
from strata.memory.pinned import ALIGN, PinnedArena


class FakePins:
    """pin / unpin over ctypes buffers, counting the calls and what is held."""

    def __init__(self, fail: bool = False, fail_over: int | None = None):
        self.held: dict[int, ctypes.Array] = {}
        self.calls, self.fail, self.fail_over = 0, fail, fail_over

    def pin(self, n: int) -> int:
        self.calls += 1
        if self.fail or self.fail_over is not None and n > self.fail_over:
            raise MemoryError("cudaErrorMemoryAllocation: out of memory")
        buf = (ctypes.c_ubyte * n)()
        self.held[ctypes.addressof(buf)] = buf
        return ctypes.addressof(buf)

    def unpin(self, ptr: int) -> None:
        del self.held[ptr]


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(pinned, "CHUNK", 64 * ALIGN)


def _free_ranges(arena):
    return [[(s, c.sizes[s]) for s in c.starts] for c in arena._chunks]


def test_ranges_are_reused_whatever_their_size():
    pins = FakePins()
    a = PinnedArena(pins.pin, pins.unpin, keep_bytes=1 << 30)
    x = a.empty((10, 1000), np.float32)          # 40,000 bytes
    x[:] = 1.5
    assert a.pins == 1 and a.used_bytes == 40960
    del x
    gc.collect()
    a.settle()
    assert a.used_bytes == 0
    y = a.empty((3, 7), np.int16)                 # a different size: the same pinned chunk serves it
    z = a.empty((60 * ALIGN // 8,), np.float64)
    assert a.pins == 1 and y.flags.c_contiguous and z.shape == (60 * ALIGN // 8,)
    y[:] = 7
    z[:] = 2.0
    assert (y == 7).all() and (z == 2.0).all()
    assert a.pinned_bytes == 64 * ALIGN


def test_a_large_array_gets_a_chunk_of_its_own_and_views_keep_it():
    pins = FakePins()
    a = PinnedArena(pins.pin, pins.unpin, keep_bytes=0)
    big = a.empty((200 * ALIGN,), np.uint8)
    assert a.pins == 1 and a.pinned_bytes >= 200 * ALIGN
    view = big[10:20]
    del big
    gc.collect()
    a.settle()
    assert a.used_bytes == 200 * ALIGN             # the view holds the range
    view[:] = 3
    del view
    gc.collect()
    a.settle()
    assert a.used_bytes == 0 and a.pinned_bytes == 0 and not pins.held   # beyond keep_bytes: back to the driver


def test_keep_bytes_holds_free_chunks_pinned():
    pins = FakePins()
    a = PinnedArena(pins.pin, pins.unpin, keep_bytes=64 * ALIGN)
    x = a.empty((ALIGN,), np.uint8)
    del x
    gc.collect()
    a.settle()
    assert a.pinned_bytes == 64 * ALIGN and len(pins.held) == 1


def test_reserve_pins_ahead_once():
    pins = FakePins()
    a = PinnedArena(pins.pin, pins.unpin)
    a.reserve(300 * ALIGN)
    assert a.pins == 1 and a.pinned_bytes >= 300 * ALIGN and a.keep_bytes >= a.pinned_bytes
    xs = [a.empty((ALIGN,), np.uint8) for _ in range(299)]
    assert a.pins == 1 and a.used_bytes == 299 * ALIGN
    a.reserve(10)                                   # enough free already: nothing pinned
    assert a.pins == 1
    xs.append(a.empty((ALIGN,), np.uint8))
    a.reserve(10)                                   # all in use: another pin
    assert a.pins == 2


def test_pinning_failure_falls_back_to_ordinary_memory_without_retrying_each_array():
    pins = FakePins(fail=True)
    a = PinnedArena(pins.pin, pins.unpin)
    xs = [a.empty((5, 5), np.float32) for _ in range(10)]
    xs[0][:] = 1
    assert a.fallbacks == 10 and a.pinned_bytes == 0 and xs[0].sum() == 25
    assert pins.calls == 1                          # one failed pin, not one per array


def test_a_refused_reserve_or_pin_is_not_held_against_later_ones():
    pins = FakePins(fail_over=100 * ALIGN)
    a = PinnedArena(pins.pin, pins.unpin)
    a.reserve(200 * ALIGN)                          # one pin of 200 pages: refused, the reserve stops there
    assert a.pinned_bytes == 0
    x = a.empty((ALIGN,), np.uint8)                 # a chunk of 64 pages still pins
    assert a.pins == 1 and a.fallbacks == 0
    big = a.empty((150 * ALIGN,), np.uint8)         # refused: ordinary memory, and no retry per array ...
    again = a.empty((150 * ALIGN,), np.uint8)
    assert a.fallbacks == 2 and pins.calls == 3
    del x
    a.settle()                                      # ... until memory came back
    small = a.empty((80 * ALIGN,), np.uint8)
    assert a.pins == 2 and pins.calls == 4
    del big, again, small


def test_a_range_freed_inside_the_arena_waits_for_the_next_call():
    """A finalizer that runs while the arena holds its lock (a garbage collection inside its own code) must not
    take the lock again: the range is pending until the next call settles it."""
    pins = FakePins()
    a = PinnedArena(pins.pin, pins.unpin, keep_bytes=1 << 30)
    x = a.empty((ALIGN,), np.uint8)
    with a._lock:
        del x                                       # the lease's finalizer runs here, under the lock
        assert len(a._pending) == 1
    a.settle()
    assert a.used_bytes == 0 and not a._pending


def test_a_range_freed_twice_is_refused():
    c = pinned._Chunk(0, 16 * ALIGN)
    off = c.take(2 * ALIGN)
    c.give(off, 2 * ALIGN)
    with pytest.raises(RuntimeError, match="freed twice"):
        c.give(off, 2 * ALIGN)


@settings(max_examples=300, deadline=None)
@given(hs.lists(hs.tuples(hs.booleans(), hs.integers(1, 90 * ALIGN), hs.integers(0, 10 ** 6)), max_size=60))
def test_fuzz_live_arrays_never_overlap_and_all_memory_comes_back(ops):
    """Random allocations and frees: every live array keeps its own bytes (a pattern written at allocation is
    intact at the end), the used bytes are the live arrays' rounded sizes, and once all are gone every chunk is
    one free range again."""
    pins = FakePins()
    a = PinnedArena(pins.pin, pins.unpin, keep_bytes=128 * ALIGN)
    live: list[tuple[np.ndarray, int]] = []
    for alloc, n, seed in ops:
        if alloc or not live:
            live.append((a.empty((n,), np.uint8), seed % 251))
            live[-1][0][:] = seed % 251
        else:
            live.pop(seed % len(live))          # reference counting frees it here (no cycles)
        a.settle()
        assert a.used_bytes == sum((len(x) + ALIGN - 1) // ALIGN * ALIGN for x, _ in live)
        assert all(x[0] == v and x[-1] == v for x, v in live)
    assert all((x == v).all() for x, v in live)
    live.clear()
    a.settle()
    assert a.used_bytes == 0
    assert all(r == [(0, c.size)] for r, c in zip(_free_ranges(a), a._chunks))
    assert a.pinned_bytes <= 128 * ALIGN                 # free chunks beyond keep_bytes went back
