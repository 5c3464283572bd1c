"""The expert store's bookkeeping (strata/moe/store.py) on the CPU, host arrays standing in for the VRAM slots: a
device whose copies land late (a FIFO copy queue that the test advances at random points, as a copy stream would),
whose table entries point at the home copy or a slot, and whose "kernels" read every routed expert through the table
and compare the bytes with the expert's own. Random decode steps, copy progress and long prefills (hypothesis) must
always read the right bytes, keep the budget and count every routing; with the settle removed, a prefill that
borrows slots while a swap is in flight makes a later read wrong."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strata.moe.policy import Policy
from strata.moe.store import FILLING, LENT, RESIDENT, ExpertStore

B = 24          # bytes per expert


class HostSlots:
    """A SlotDevice over numpy arrays. Compute-stream work (point, reads) happens at once; copies queue and land when
    `progress` or `wait` runs them, in order."""

    def __init__(self, n_keys: int, n_slots: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.home = rng.integers(0, 256, (n_keys, B), dtype=np.uint8)
        self.slots = np.zeros((n_slots, B), dtype=np.uint8)
        self.table = np.full(n_keys, -1, dtype=np.int64)        # -1: home, else a slot
        self.queue: list[tuple[int, int, int]] = []             # (event, slot, key)
        self.landed = 0                                          # events up to this one have completed
        self.next_ev = 0
        self.counts = np.zeros(n_keys, dtype=np.int64)

    # SlotDevice
    def compute_mark(self):
        return None

    def copy_in(self, slot, key, after):
        self.next_ev += 1
        self.queue.append((self.next_ev, int(slot), int(key)))
        return self.next_ev

    def done(self, ev):
        return ev <= self.landed

    def wait(self, ev):
        while self.landed < ev:
            self.progress(1)

    def compute_after(self, ev):
        self.wait(ev)

    def point(self, keys, slots):
        for k, s in zip(keys, slots):
            self.table[k] = -1 if s is None else s

    def read_counts(self):
        c, self.counts = self.counts, np.zeros_like(self.counts)
        return c

    # the test's side
    def progress(self, n):
        for _ in range(min(n, len(self.queue))):
            ev, s, k = self.queue.pop(0)
            self.slots[s] = self.home[k]
            self.landed = ev

    def compute(self, keys, count=True):
        """The kernels reading experts `keys` through the table: the bytes they see must be the expert's."""
        for k in keys:
            s = self.table[k]
            got = self.home[k] if s < 0 else self.slots[s]
            assert np.array_equal(got, self.home[k]), f"expert {k} read from slot {s} holds other bytes"
            if count:
                self.counts[k] += 1


def _store(n_layers=3, ne=8, n_slots=6, every=2, swaps=3, dwell=2, lend_rows=4, seed=0):
    dev = HostSlots(n_layers * ne, n_slots, seed)
    pol = Policy(every=every, swaps=swaps, min_dwell=dwell, margin=0.1, half_life=8)
    return ExpertStore(list(range(1, 2 * n_layers, 2)), ne, n_slots, B, dev, pol, lend_rows=lend_rows), dev


def _routes(rng, n_layers, ne, k, hot):
    """k distinct experts per layer, skewed towards the `hot` ones."""
    p = np.ones(ne)
    p[hot] = 12.0
    p /= p.sum()
    return [r * ne + e for r in range(n_layers) for e in rng.choice(ne, k, replace=False, p=p)]


def _check_books(store, dev):
    res = store.resident()
    assert res.sum() <= store.n_slots
    for s in range(store.n_slots):
        if store.state[s] == RESIDENT:
            k = store.owner[s]
            assert dev.table[k] == s and store.slot_of[k] == s
        elif store.state[s] == FILLING:
            assert store.slot_of[store.pending[s][0]] == s and dev.table[store.pending[s][0]] == -1
    # every entry that points at a slot is that slot's resident expert, or a staged one under a loan
    for k in np.flatnonzero(dev.table >= 0):
        s = dev.table[k]
        assert (store.state[s] == RESIDENT and store.owner[s] == k) or \
            (store.state[s] == LENT and store.loan is not None and k in store.loan.staged)


ops = st.lists(st.one_of(st.tuples(st.just("decode"), st.integers(1, 6)),
                         st.tuples(st.just("copies"), st.integers(0, 5)),
                         st.tuples(st.just("prefill"), st.integers(1, 12)),
                         st.tuples(st.just("shift"), st.integers(0, 7))), min_size=1, max_size=40)


@settings(max_examples=300, deadline=None)
@given(ops, st.integers(0, 2 ** 16), st.integers(2, 10), st.integers(0, 2))
def test_random_decode_prefill_and_copies_read_the_right_bytes(plan, seed, n_slots, dwell):
    """Whatever the order of decode steps, copies landing and prefills, every expert read through the table holds its
    own bytes, the slot books agree with the table, and every routing is counted once as a hit or a miss."""
    n_layers, ne, k = 3, 8, 3
    store, dev = _store(n_layers, ne, n_slots, dwell=dwell, seed=seed)
    rng = np.random.default_rng(seed)
    hot = [0, 1, 2]
    routed = 0
    for op, arg in plan:
        if op == "decode":
            for _ in range(arg):
                keys = _routes(rng, n_layers, ne, k, hot)
                dev.compute(keys)
                routed += len(keys)
                store.step(1)
                _check_books(store, dev)
        elif op == "copies":
            dev.progress(arg)
        elif op == "shift":
            hot = [(h + arg) % ne for h in hot]
        else:
            store.begin_prefill(arg)
            for r, li in enumerate(store.layers):
                store.before_layer(li)
                _check_books(store, dev)
                dev.progress(int(rng.integers(0, 3)))
                layer_keys = sorted({r * ne + e for _ in range(arg)
                                     for e in rng.choice(ne, k, replace=False)})
                dev.compute(layer_keys)
                routed += len(layer_keys)
                store.after_layer(li)
            store.end_prefill()
            _check_books(store, dev)
    store.settle()
    _check_books(store, dev)
    assert not store.pending
    store.adapt()
    total = sum(s.hits + s.misses + s.prefill_hits + s.prefill_misses for s in store.stats)
    assert total == routed


def _swap_in_flight_then_prefill(settle: bool):
    """Slots filled, the hot set moved so that a round starts swaps, their copies still in flight when a long prefill
    begins; then decoding resumes. Returns the first wrong read's message, or None."""
    store, dev = _store(n_layers=2, ne=8, n_slots=4, every=2, swaps=4, dwell=0, lend_rows=4)
    if not settle:
        store.settle = lambda: None
    rng = np.random.default_rng(1)
    try:
        for hot, land in (([0, 1], 1), ([5, 6], 0)):     # the second hot set's copies stay in flight
            for _ in range(8):
                dev.compute(_routes(rng, 2, 8, 2, hot))
                store.step(1)
                dev.progress(land)
        assert store.pending, "the scenario needs swaps in flight when the prefill starts"
        store.begin_prefill(16)
        for r, li in enumerate(store.layers):
            store.before_layer(li)
            dev.compute(range(r * 8, r * 8 + 8))
            store.after_layer(li)
        store.end_prefill()
        for _ in range(16):
            dev.compute(_routes(rng, 2, 8, 2, [5, 6]))
            store.step(1)
            dev.progress(1)
    except AssertionError as e:
        return str(e)
    return None


def test_settle_before_lending_is_what_keeps_reads_right():
    """With the settle a prefill borrowing slots during swaps in flight reads right, and decoding after it too;
    without it, a swap that was in flight when its slot was lent later points its expert at the prefill's bytes."""
    assert _swap_in_flight_then_prefill(settle=True) is None
    wrong = _swap_in_flight_then_prefill(settle=False)
    assert wrong is not None and "holds other bytes" in wrong


def test_rounds_follow_the_hot_set_and_respect_the_copy_cap():
    store, dev = _store(n_layers=1, ne=8, n_slots=2, every=4, swaps=2, dwell=0)
    rng = np.random.default_rng(0)
    for _ in range(16):
        dev.compute(_routes(rng, 1, 8, 2, [3, 4]))
        store.step(1)
        dev.progress(4)
    store.settle()
    assert sorted(np.flatnonzero(store.resident()).tolist()) == [3, 4]
    s = store.status()
    assert s["resident"] == 2 and s["layers"][0]["resident"] == [3, 4] and s["swaps"] >= 2
    assert s["bytes_moved"] == B * (s["swaps"] + sum(L["staged"] for L in s["layers"]))
    # a copy-rate cap of one expert per second on a clock that does not move: one swap, then none
    t = [0.0]
    store2 = ExpertStore([0], 8, 4, B, HostSlots(8, 4), Policy(every=1, swaps=4, min_dwell=0, half_life=8),
                         rate=float(B), clock=lambda: t[0])
    store2.dev.counts[:] = 5
    t[0] = 1.0
    assert len(store2.adapt()) == 1
    store2.dev.counts[:] = 5
    assert store2.adapt() == []
    t[0] = 3.0
    store2.dev.counts[:] = 5
    assert len(store2.adapt()) == 2          # two seconds at one expert a second


def test_a_loan_gives_its_slots_back_to_the_experts_they_held():
    """A long prefill borrows resident slots; afterwards (once the copies land) the same experts are resident in
    the same slots, and a static placement survives prefills."""
    store, dev = _store(n_layers=2, ne=8, n_slots=6, every=1, dwell=0, lend_rows=4)
    store.place([0, 1, 2, 8, 9, 10])
    store.static = True
    before = store.owner.copy()
    for _ in range(3):
        assert store.begin_prefill(32)
        assert store.status()["lent"] == 6 and not store.resident().any()
        for r, li in enumerate(store.layers):
            store.before_layer(li)
            dev.compute(range(r * 8, r * 8 + 8))
            store.after_layer(li)
        store.end_prefill()
        store.settle()
        assert (store.owner == before).all() and store.resident().sum() == 6
    dev.compute([0, 1, 2, 3, 8, 9])
    store.step(1)
    st = store.status()
    assert (st["hits"], st["misses"]) == (5, 1) and st["bytes_read_host"] == B
    assert sum(L["prefill_misses"] for L in st["layers"]) == 3 * 16


def test_a_loan_refill_keeps_the_dwell_so_rounds_go_on_after_a_prefill():
    """An expert given back its slot after a prefill keeps the dwell it had: a long-resident cold expert can leave at
    the next round. (Restarting the dwell at the refill froze every lent slot for min_dwell decoded tokens after each
    prompt, so with a prompt every min_dwell tokens the rounds never swapped.)"""
    store, dev = _store(n_layers=1, ne=8, n_slots=4, every=4, swaps=4, dwell=8, lend_rows=4)
    store.place([0, 1, 2, 3])
    for _ in range(8):                       # the placement dwells 8 tokens on routings to 0 and 1 only
        dev.compute([0, 1])
        store.step(1)
    assert store.begin_prefill(16)
    store.before_layer(store.layers[0])
    dev.compute(range(8), count=False)
    store.after_layer(store.layers[0])
    store.end_prefill()
    store.settle()
    assert sorted(np.flatnonzero(store.resident()).tolist()) == [0, 1, 2, 3]
    assert (store.dwell[[0, 1, 2, 3]] >= 8).all()
    for _ in range(4):                       # 6 and 7 turn hot: they replace the cold 2 and 3 at the next round
        dev.compute([0, 6, 7])
        store.step(1)
    store.settle()
    assert sorted(np.flatnonzero(store.resident()).tolist()) == [0, 1, 6, 7]


def test_static_placement_fills_the_hottest_and_never_swaps():
    store, dev = _store(n_layers=1, ne=8, n_slots=3, every=1, dwell=0)
    dev.counts[[6, 2, 7]] = [9, 5, 7]
    store.place_hottest()
    store.static = True
    assert sorted(np.flatnonzero(store.resident()).tolist()) == [2, 6, 7]
    dev.counts[[0, 1]] = 50
    store.step(1)
    assert sorted(np.flatnonzero(store.resident()).tolist()) == [2, 6, 7] and not store.pending


def test_bad_policy_is_refused():
    with pytest.raises(ValueError, match="--adapt-every"):
        ExpertStore([0], 4, 2, B, HostSlots(4, 2), Policy(every=0))


def test_prefill_weight_scales_prompt_routings_in_the_usage():
    """prefill_weight 0.25: a prompt's routings count a quarter of a decoded token's in the usage."""
    dev = HostSlots(8, 2)
    store = ExpertStore([0], 8, 2, B, dev, Policy(every=100, swaps=2, min_dwell=0, half_life=1e9,
                                                  prefill_weight=0.25))
    store.begin_prefill(1)
    dev.compute([3] * 8)
    store.end_prefill()
    dev.compute([5] * 4)
    store.adapt()
    assert store.usage[3] == pytest.approx(2.0) and store.usage[5] == pytest.approx(4.0)
