"""The expert store of one stage, device-independent: which expert each VRAM slot holds, the swaps in flight, the
usage counts and the policy rounds, the slots lent to a prefill, the settle, and the tier's numbers for /status.

Every routed expert has a home copy (its GGUF blocks in pinned host RAM, readable by the kernels) and may also have
a copy in one of ``n_slots`` VRAM slots. The kernels read an expert through its table entry, which points at the
home copy or at a slot that holds exactly that expert's bytes; both hold the same bits, so a miss is exact. The
device (``SlotDevice``: the CUDA one in strata/backend/cuda/moe_tier.py, host arrays in the tests) does the copies
on a copy stream, the events, and repoints entries in stream order on the compute stream.

A swap: the leaving expert's entry is pointed home on the compute stream, a mark is recorded there, and the copy of
the incoming expert into the slot starts on the copy stream after that mark (nothing still reads the old bytes);
when its event has completed (polled between decode steps) the incoming entry is pointed at the slot. A slot is
FREE, FILLING (a copy in flight), RESIDENT or LENT.

Prefill borrows slots: ``begin_prefill`` first settles (waits for every copy in flight and points its expert at its
slot), then lends the free slots and the coldest resident ones (their experts pointed home) as two halves; before
each MoE layer the layer's hottest non-resident experts are copied into one half (after the mark of the layer that
last used it) and their entries pointed there once the copies are done; after the layer they are pointed home again.
``end_prefill`` returns the slots as free; the next rounds fill them. Without the settle a lent slot may be one a
copy is still writing, and that copy's completion would point its expert at bytes the prefill has overwritten.

Flat expert index: ``row * n_expert + e`` over the stage's MoE layers in order (row: the layer's place among them).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import numpy as np

from strata.moe.policy import Policy, Swap, decayed, hottest, plan_swaps

FREE, FILLING, RESIDENT, LENT = 0, 1, 2, 3


class SlotDevice(Protocol):
    """What the store asks of a device. Keys are flat expert indices; slot None means the home copy."""

    def compute_mark(self) -> Any:
        """An event after everything enqueued on the compute stream so far."""

    def copy_in(self, slot: int, key: int, after: Any) -> Any:
        """Enqueue the copy of expert `key`'s home bytes into `slot` on the copy stream, after the compute mark
        `after` (None: no wait); returns its event."""

    def done(self, event: Any) -> bool:
        """Whether the event has completed (no wait)."""

    def wait(self, event: Any) -> None:
        """Block the host until the event has completed."""

    def compute_after(self, event: Any) -> None:
        """Make the compute stream wait for a copy event."""

    def point(self, keys: list[int], slots: list[int | None]) -> None:
        """Point each key's table entry at its slot (None: home), in order on the compute stream."""

    def read_counts(self) -> np.ndarray:
        """The routings counted since the last call (int, one per flat key), and clear them."""


@dataclass
class LayerStats:
    """Counters of one MoE layer: decoded tokens' routings whose expert was resident (hits) or not (misses: read
    from the home copy over PCIe), the same for prompt tokens (prefill_hits / prefill_misses; a miss there is read
    from the home copy or from the prompt's lent slots), experts copied into slots (swaps, loans given back),
    experts staged for prefills, bytes copied to the device (swaps and staging)."""

    hits: int = 0
    misses: int = 0
    prefill_hits: int = 0
    prefill_misses: int = 0
    swaps: int = 0
    staged: int = 0
    bytes_moved: int = 0


@dataclass
class _Loan:
    halves: tuple[list[int], list[int]]
    marks: list[Any] = field(default_factory=lambda: [None, None])
    turn: int = 0
    staged: list[int] = field(default_factory=list)     # keys pointed at lent slots for the current layer
    held: dict[int, int] = field(default_factory=dict)  # lent slot -> the expert it held (refilled at the end)


class ExpertStore:
    """The slots and bookkeeping of one stage's expert tier (see the module docstring).

    layers: the MoE layers' indices in the model (their order gives the rows); n_expert: experts per layer; n_slots:
    VRAM slots; expert_bytes: one expert's bytes (what a copy moves); dev: the SlotDevice; rate: bytes per second the
    swaps may copy (None: no cap); lend_rows: a prefill of at least that many rows borrows slots (0: never);
    clock: seconds (time.monotonic; the tests pass their own)."""

    def __init__(self, layers: list[int], n_expert: int, n_slots: int, expert_bytes: int, dev: SlotDevice,
                 policy: Policy, rate: float | None = None, lend_rows: int = 64,
                 clock: Callable[[], float] = time.monotonic):
        why = policy.problem()
        if why:
            raise ValueError(why)
        self.layers, self.n_expert = list(layers), int(n_expert)
        self.n = len(self.layers) * self.n_expert
        self.n_slots, self.expert_bytes, self.dev, self.policy = int(n_slots), int(expert_bytes), dev, policy
        self.rate, self.lend_rows, self.clock = rate, int(lend_rows), clock
        self.state = np.full(self.n_slots, FREE, dtype=np.int8)
        self.owner = np.full(self.n_slots, -1, dtype=np.int64)      # the expert a FILLING / RESIDENT slot holds
        self.slot_of = np.full(self.n, -1, dtype=np.int64)          # the slot of a FILLING / RESIDENT expert
        self.pending: dict[int, tuple[int, Any]] = {}               # slot -> (expert, copy event): FILLING
        self.usage = np.zeros(self.n, dtype=np.float64)
        self.dwell = np.zeros(self.n, dtype=np.int64)
        self.stats = [LayerStats() for _ in self.layers]
        self.tokens = 0                                             # decoded tokens since the last round
        self.undecayed = 0                                          # decoded tokens since the usage last decayed
        self.rounds = 0
        self.allowance = 0.0                                        # bytes the copy-rate cap allows now
        self._last = clock()
        self.loan: _Loan | None = None
        self.static = False                                         # a fixed placement: no rounds

    # ---- views
    def resident(self) -> np.ndarray:
        """bool (n,): experts whose entry points at a slot."""
        out = np.zeros(self.n, dtype=bool)
        out[self.owner[self.state == RESIDENT]] = True
        return out

    def row_of(self, layer: int) -> int:
        return self.layers.index(layer)

    # ---- decoding
    def step(self, n_tokens: int = 1) -> None:
        """After n decoded tokens: finished copies take effect; every policy.every tokens a round."""
        self._end_loan()
        self.poll()
        self.dwell += int(n_tokens)
        self.tokens += int(n_tokens)
        self.undecayed += int(n_tokens)
        if self.tokens >= self.policy.every:
            self.adapt()

    def poll(self) -> int:
        """Point every expert whose copy has completed at its slot; returns how many."""
        ready = [s for s, (_, ev) in self.pending.items() if self.dev.done(ev)]
        self._finish(ready)
        return len(ready)

    def _finish(self, slots: list[int]) -> None:
        if not slots:
            return
        keys = [self.pending.pop(s)[0] for s in slots]
        self.dev.point(keys, list(slots))
        for s, k in zip(slots, keys):           # the dwell runs from _fill (a loan's refill keeps the one it had)
            self.state[s], self.owner[s], self.slot_of[k] = RESIDENT, k, s

    def observe(self, counts: np.ndarray, prefill: bool = False) -> None:
        """Fold routings counted since the last call into the usage (decayed over the tokens decoded meanwhile) and
        the per-layer hit counters (of decode, or of prefill)."""
        counts = np.asarray(counts).reshape(-1)
        res = self.resident()
        by_row = counts.reshape(len(self.layers), self.n_expert)
        hit = (by_row * res.reshape(by_row.shape)).sum(axis=1)
        for r, st in enumerate(self.stats):
            miss = int(by_row[r].sum() - hit[r])
            if prefill:
                st.prefill_hits += int(hit[r])
                st.prefill_misses += miss
            else:
                st.hits += int(hit[r])
                st.misses += miss
        w = self.policy.prefill_weight if prefill else 1.0
        self.usage = decayed(self.usage, counts * w, self.policy.decay(self.undecayed))
        self.undecayed = 0

    def adapt(self) -> list[Swap]:
        """One round: read the counts, decay the usage, start the policy's swaps within the copy-rate cap."""
        self.observe(self.dev.read_counts())
        self.tokens = 0
        self.rounds += 1
        if self.static or self.n_slots == 0:
            return []
        cap = None
        if self.rate is not None:
            now = self.clock()
            per_round = self.policy.swaps * self.expert_bytes
            # unused allowance is kept up to one round's swaps or one second of copying, whichever is more
            self.allowance = min(self.allowance + (now - self._last) * self.rate,
                                 max(per_round, self.rate, self.expert_bytes))
            self._last = now
            cap = int(self.allowance // self.expert_bytes)
        busy = self.state != FREE
        held = np.zeros(self.n, dtype=bool)
        held[self.owner[busy & (self.state != LENT)]] = True
        swaps = plan_swaps(self.usage, held, self.dwell, self.n_slots - int((self.state == LENT).sum()),
                           self.policy, cap)
        for sw in swaps:
            self._start(sw)
        if self.rate is not None:
            self.allowance -= len(swaps) * self.expert_bytes
        return swaps

    def _start(self, sw: Swap) -> None:
        if sw.out is not None:
            slot = int(self.slot_of[sw.out])
            if self.state[slot] == FILLING:           # the policy counts a copy in flight as resident: let it land
                self.dev.wait(self.pending[slot][1])
                self._finish([slot])
            self.dev.point([sw.out], [None])
            self.slot_of[sw.out] = -1
        else:
            slot = int(np.flatnonzero(self.state == FREE)[0])
        self._fill(slot, sw.into)

    def _fill(self, slot: int, key: int, dwell: int = 0) -> None:
        ev = self.dev.copy_in(slot, key, self.dev.compute_mark())
        self.pending[slot] = (key, ev)
        self.state[slot], self.owner[slot], self.slot_of[key] = FILLING, key, slot
        self.dwell[key] = dwell
        st = self.stats[key // self.n_expert]
        st.swaps += 1
        st.bytes_moved += self.expert_bytes

    def place(self, keys) -> None:
        """Fill the slots with `keys` (a static placement, at most n_slots of them, hottest first), replacing what
        they held, and wait for the copies."""
        self.settle()
        keys = [int(k) for k in keys][:self.n_slots]
        old = [int(k) for k in self.owner[self.state == RESIDENT]]
        if old:
            self.dev.point(old, [None] * len(old))
        self.slot_of[:] = -1
        self.owner[:] = -1
        self.state[:] = FREE
        for i, k in enumerate(keys):
            self._fill(i, k)
        self.settle()

    def place_hottest(self) -> None:
        """A static placement from the usage seen so far (read from the device first)."""
        self.observe(self.dev.read_counts())
        self.place(hottest(self.usage, self.n_slots).tolist())

    # ---- the settle and prefill's loan
    def settle(self) -> None:
        """Wait for every copy in flight and point its expert at its slot (before slots are lent, and before a
        prefill reads through the tables)."""
        self._end_loan()
        for _, ev in list(self.pending.values()):
            self.dev.wait(ev)
        self._finish(list(self.pending))

    def begin_prefill(self, n_rows: int) -> bool:
        """Before a prefill's first MoE layer: settle, fold the decode steps' routings in; with at least lend_rows
        rows, lend slots (two halves, each as many as the most non-resident experts of a layer; free slots first,
        then the coldest resident ones). Returns whether slots were lent."""
        self.settle()
        self.observe(self.dev.read_counts())
        if self.lend_rows <= 0 or n_rows < self.lend_rows or self.n_slots < 2:
            return False
        res = self.resident().reshape(len(self.layers), self.n_expert)
        need = int((~res).sum(axis=1).max()) if len(self.layers) else 0
        want = min(self.n_slots, 2 * need) // 2 * 2
        if want < 2:
            return False
        free = np.flatnonzero(self.state == FREE).tolist()
        taken = free[:want]
        if len(taken) < want:
            cand = np.flatnonzero(self.state != FREE)
            cand = cand[np.lexsort((cand, self.usage[self.owner[cand]]))]      # the coldest owners first
            taken += cand[:want - len(taken)].tolist()
        evicted = [int(self.owner[s]) for s in taken if self.state[s] == RESIDENT]
        held = {int(s): int(self.owner[s]) for s in taken if self.state[s] == RESIDENT}
        if evicted:
            self.dev.point(evicted, [None] * len(evicted))
        for s in taken:
            if self.owner[s] >= 0:
                self.slot_of[self.owner[s]] = -1
            self.owner[s] = -1
            self.state[s] = LENT
        half = want // 2
        self.loan = _Loan((taken[:half], taken[half:]), held=held)
        return True

    def before_layer(self, layer: int) -> None:
        """Under a loan: copy the layer's hottest non-resident experts into the next half of the lent slots and point
        them there once the copies are done (the compute stream waits for them)."""
        ln = self.loan
        if ln is None:
            return
        row = self.row_of(layer)
        keys = np.arange(row * self.n_expert, (row + 1) * self.n_expert)
        keys = keys[self.slot_of[keys] < 0]
        keys = keys[np.lexsort((keys, -self.usage[keys]))]
        half = ln.halves[ln.turn % 2]
        keys = keys[:len(half)].tolist()
        ev = None
        mark = ln.marks[ln.turn % 2]
        for s, k in zip(half, keys):
            ev = self.dev.copy_in(s, k, mark)
        if ev is not None:
            self.dev.compute_after(ev)
            self.dev.point(keys, half[:len(keys)])
        st = self.stats[row]
        st.staged += len(keys)
        st.bytes_moved += len(keys) * self.expert_bytes
        ln.staged = keys

    def after_layer(self, layer: int) -> None:
        """Under a loan: the layer's staged experts pointed home again, and the half's mark recorded."""
        ln = self.loan
        if ln is None:
            return
        if ln.staged:
            self.dev.point(ln.staged, [None] * len(ln.staged))
        ln.marks[ln.turn % 2] = self.dev.compute_mark()
        ln.staged = []
        ln.turn += 1

    def end_prefill(self) -> None:
        """After a prefill's last MoE layer: its routings folded in (as prefill's), the lent slots given back."""
        self._end_loan()
        self.observe(self.dev.read_counts(), prefill=True)

    def _end_loan(self) -> None:
        """The lent slots come back: each refilled with the expert it held before the loan (its copy starts after
        the prefill's last reader: _fill's compute mark), the others free."""
        ln = self.loan
        if ln is None:
            return
        if ln.staged:
            self.dev.point(ln.staged, [None] * len(ln.staged))
        self.loan = None
        self.state[self.state == LENT] = FREE
        for slot, key in ln.held.items():
            if self.slot_of[key] < 0 and self.state[slot] == FREE:
                self._fill(slot, key, int(self.dwell[key]))

    # ---- numbers
    def status(self) -> dict[str, Any]:
        """JSON-ready numbers: slots (total, resident, filling, lent), rounds, decode hits / misses / hit rate,
        swaps, staged experts, bytes copied to the device (bytes_moved) and bytes decode steps read from host RAM
        (bytes_read_host: misses times an expert's bytes), and the same per layer with its resident experts and the
        prefill's hits / misses."""
        res = self.resident().reshape(len(self.layers), self.n_expert)
        per = []
        for r, (li, st) in enumerate(zip(self.layers, self.stats)):
            seen = st.hits + st.misses
            per.append({"layer": li, "resident": np.flatnonzero(res[r]).tolist(), "hits": st.hits,
                        "misses": st.misses, "hit_rate": round(st.hits / seen, 4) if seen else None,
                        "prefill_hits": st.prefill_hits, "prefill_misses": st.prefill_misses,
                        "swaps": st.swaps, "staged": st.staged, "bytes_moved": st.bytes_moved,
                        "bytes_read_host": st.misses * self.expert_bytes})
        hits, seen = sum(s.hits for s in self.stats), sum(s.hits + s.misses for s in self.stats)
        return {"slots": self.n_slots, "resident": int((self.state == RESIDENT).sum()),
                "filling": int((self.state == FILLING).sum()), "lent": int((self.state == LENT).sum()),
                "expert_bytes": self.expert_bytes, "rounds": self.rounds, "static": self.static,
                "hit_rate": round(hits / seen, 4) if seen else None, "hits": hits, "misses": seen - hits,
                "swaps": sum(s.swaps for s in self.stats), "staged": sum(s.staged for s in self.stats),
                "bytes_moved": sum(s.bytes_moved for s in self.stats),
                "bytes_read_host": (seen - hits) * self.expert_bytes,
                "layers": per}
