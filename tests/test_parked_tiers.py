"""The parked conversations as nodes of the checkpoint tree (strata.cache.parked): random parks, switches (the best
one taken), pools short of pages and discards against a plain list that applies the documented policy: one
conversation per token sequence, each tier least recently used first down (device count -> host RAM bytes -> disk
files -> gone), one lookup over every tier (deepest, then the nearest tier, then the most recent). A conversation
holds (pins) the tree's checkpoint on its path instead of a copy: in memory it counts its share of that checkpoint's
bytes (split evenly among its holders, rounded up), its file only its own; every pin is held by a kept one."""
from __future__ import annotations

import itertools

import numpy as np
from hypothesis import given, settings, strategies as hs

import strata.cache.parked as parked_mod
from types import SimpleNamespace

from strata.cache.conversation import Conversation
from strata.cache.disk import DiskTier
from strata.cache.lookup import lookup
from strata.cache.parked import ParkedConversations
from strata.cache.tree import CheckpointTree

TIER_RANK = {"device": 0, "ram": 1, "disk": 2}


class _Clock:
    """time.time for the module under test: strictly increasing, so recency has no ties."""

    def __init__(self):
        self.t = itertools.count(1)

    def time(self) -> float:
        return float(next(self.t))

    @staticmethod
    def perf_counter() -> float:
        return 0.0


def _files(tmp):
    def write(path, conv):
        data = np.asarray(conv.tokens, np.int32).tobytes()
        path.write_bytes(data)
        return len(data)

    def read(path):
        return Conversation(tokens=np.frombuffer(path.read_bytes(), np.int32), parts=[])
    return write, read


def _cp_bytes(key) -> int:
    """The bytes of the tree's checkpoint at the prefix `key` (what the test keeps there): odd, so that a share among
    two holders is rounded."""
    return 1 + 2 * (len(key) + sum(key))


class _Model:
    """The reference: records [tokens, tier, last_use, None, checkpoint position (0: none)] in a list; a record's size
    (``size``) is its tokens' bytes, plus in memory its share of its checkpoint's bytes among the records holding it
    (``pending``: the one being parked, which holds its checkpoint already)."""

    def __init__(self, resident, ram, disk):
        self.resident, self.ram, self.disk = resident, ram, disk
        self.recs: list[list] = []
        self.pending: list[list] = []
        self.now = 0

    def holders(self, key) -> int:
        return sum(1 for r in self.recs + self.pending if r[4] and r[0][:r[4]] == key)

    def size(self, r) -> int:
        n = 4 * len(r[0])
        if r[1] == "disk" or not r[4]:
            return n
        key = r[0][:r[4]]
        return n - (-_cp_bytes(key) // self.holders(key))

    def _lru(self, tier):
        return min((r for r in self.recs if r[1] == tier), key=lambda r: r[2])

    def _down(self, r):
        if r[1] == "device":
            r[1] = "ram"
            if self.size(r) > self.ram:
                self._down(r)
            else:
                self._settle("ram")
        elif r[1] == "ram":
            if self.disk is None or 4 * len(r[0]) > self.disk:
                self.recs.remove(r)
                return
            r[1] = "disk"
            while sum(self.size(x) for x in self.recs if x[1] == "disk") > self.disk:
                self.recs.remove(self._lru("disk"))

    def _settle(self, tier):
        if tier == "device":
            while sum(r[1] == "device" for r in self.recs) > self.resident:
                self._down(self._lru("device"))
            return
        ram = sorted((r for r in self.recs if r[1] == "ram"), key=lambda r: r[2])
        sizes = [self.size(r) for r in ram]                 # the victims chosen at once, then moved down in turn
        total, victims = sum(sizes), []
        for r, n in zip(ram, sizes):
            if total <= self.ram:
                break
            victims.append(r)
            total -= n
        for r in victims:
            self._down(r)

    def park(self, toks, resident, now, cp):
        tier = "device" if resident and self.resident > 0 else "ram"
        r = [toks, tier, now, None, cp]
        self.pending = [r]
        if tier == "ram" and self.size(r) > self.ram:  # over RAM alone: straight to disk, else not kept
            self.pending = []
            if self.disk is None or 4 * len(toks) > self.disk:
                return
            r[1] = "disk"
            self.recs.append(r)
            while sum(self.size(x) for x in self.recs if x[1] == "disk") > self.disk:
                self.recs.remove(self._lru("disk"))
            self.recs = [x for x in self.recs if x[0] != toks or x is r]
            return
        self.pending = []
        self.recs = [x for x in self.recs if x[0] != toks]
        self.recs.append(r)
        self._settle(tier)

    @staticmethod
    def depth(r, prompt):
        """The conversation's whole length when the prompt extends it, else its checkpoint when the prompt holds
        its tokens up to there (one prompt token at least is left to read)."""
        if len(r[0]) < len(prompt) and tuple(prompt[:len(r[0])]) == r[0]:
            return len(r[0])
        k = r[4]
        return k if 0 < k < len(prompt) and tuple(prompt[:k]) == r[0][:k] else 0

    def best(self, prompt):
        cand = [(self.depth(r, prompt), -TIER_RANK[r[1]], r[2], i) for i, r in enumerate(self.recs)]
        cand = [c for c in cand if c[0] > 0]
        if not cand:
            return None, 0
        c = max(cand)
        return self.recs[c[3]], c[0]

    def make_room(self):
        dev = [r for r in self.recs if r[1] == "device"]
        if not dev:
            return False
        self._down(self._lru("device"))
        return True

    def view(self):
        return sorted((r[1], r[0], self.size(r)) for r in self.recs)


@hs.composite
def _park(draw):
    toks = draw(_toks)
    cp = draw(hs.integers(0, len(toks) - 1))           # a checkpoint of the conversation at cp (0: none)
    return "park", (toks, cp), draw(hs.booleans())


_toks = hs.lists(hs.integers(1, 2), min_size=1, max_size=5).map(tuple)
_ops = hs.lists(hs.one_of(
    _park(),
    hs.tuples(hs.just("take"), hs.lists(hs.integers(1, 2), min_size=2, max_size=7).map(tuple), hs.just(False)),
    hs.tuples(hs.just("room"), hs.just(()), hs.just(False)),
    hs.tuples(hs.just("discard"), _toks, hs.just(False))), max_size=60)


@settings(max_examples=600, deadline=None)
@given(ops=_ops, resident=hs.integers(0, 3), ram=hs.integers(0, 60), disk=hs.one_of(hs.none(), hs.integers(1, 80)))
def test_parked_conversations_follow_the_policy(ops, resident, ram, disk, tmp_path_factory):
    real, parked_mod.time = parked_mod.time, _Clock()
    try:
        _play(ops, resident, ram, disk, tmp_path_factory.mktemp("disk"))
    finally:
        parked_mod.time = real


def _play(ops, resident, ram, disk, d):
    write, read = _files(d)
    tier = DiskTier(d, disk, write=write, read=read) if disk is not None else None
    tree = CheckpointTree()
    p = ParkedConversations(tree, [], park_bytes=ram, resident=resident, disk=tier)
    ref = _Model(resident, ram, disk)
    for op, toks, res in ops:
        if op == "park":
            toks, cp = toks
            conv = Conversation(tokens=np.array(toks, np.int32), parts=[], resident=res)
            if cp:                                      # the tree's checkpoint at cp, held by the conversation
                node = tree.find(toks[:cp])
                if node is None or node.value is None:
                    node, _ = tree.put(toks[:cp], SimpleNamespace(bytes=_cp_bytes(toks[:cp]), tier="ram"))
                tree.pin(node)
                conv.pins = [node]
            p.park(conv)
            ref.park(toks, res, conv.last_use, cp)
        elif op == "take":
            found = lookup(tree, np.array(toks, np.int32))
            got, depth = found.parked, found.depth
            want, want_depth = ref.best(toks)
            assert (got is None) == (want is None)
            if got is not None:
                assert (tuple(got.conv.tokens.tolist()), got.tier, depth) == (want[0], want[1], want_depth)
                conv = p.take(got)
                assert tuple(np.asarray(conv.tokens).tolist()) == want[0]
                assert [n.pos for n in conv.pins] == ([want[4]] if want[4] else [])   # its pins came with it
                p.unpin(conv)
                ref.recs.remove(want)
        elif op == "room":
            assert p.make_room() == ref.make_room()
        else:
            p.discard(np.array(toks, np.int32))
            ref.recs = [r for r in ref.recs if not (r[0] == toks and r[1] != "disk")]
        entries = sorted((e["tier"], e["tokens"], e["bytes"]) for e in p.entries())
        assert entries == sorted((r[1], len(r[0]), ref.size(r)) for r in ref.recs)
        assert sorted((n.parked.tier, tuple(n.tokens().tolist()), n.parked.nbytes())
                      for n in tree.nodes("parked")) == ref.view()
        assert tree.count("parked") == len(ref.recs)
        assert tree.pin_count() == sum(1 for r in ref.recs if r[4])     # every pin held by a kept conversation
        files = sorted(f.name for f in d.glob("park-*.bin"))
        assert len(files) == sum(r[1] == "disk" for r in ref.recs)
    p.clear("device")
    p.clear("ram")
    assert {e["tier"] for e in p.entries()} <= {"disk"}
    p.clear("disk")
    assert p.entries() == [] and tree.pin_count() == 0 and not list(d.glob("*.bin"))
    assert len(tree.nodes("parked")) == 0
