"""The tree's one walk along a prompt (strata.cache.lookup) against a scan of every kept prefix written from the
documented rules: the deepest checkpoint shorter than the prompt on its path, and the parked conversation that skips
most of the prompt (its whole length when the prompt extends it and it may be continued; the common prefix, at most
len(prompt) - 1, when it can be cut anywhere and shares at least CUT_MIN tokens and half of itself; else its deepest
checkpoint within the common prefix and shorter than the prompt), ties to the nearest tier, the most recent, the
last parked; a file the disk tier removed passed over; the walk changes nothing."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
from hypothesis import given, settings, strategies as hs

from strata.cache.conversation import CUT_MIN, Conversation, SavedCheckpoint
from strata.cache.lookup import lookup
from strata.cache.parked import Parked
from strata.cache.tree import CheckpointTree
from tests.helpers import full_sweeps

TIER_RANK = {"device": 0, "ram": 1, "disk": 2}


def _common(a, b) -> int:
    k = 0
    while k < len(a) and k < len(b) and a[k] == b[k]:
        k += 1
    return k


def _depth(r, prompt) -> int:
    toks, cps, live_ok, cut = r["toks"], r["cps"], r["live_ok"], r["cut"]
    n, c = len(prompt), _common(r["toks"], prompt)
    if live_ok and c == len(toks) < n:
        return len(toks)
    deepest = max([p for p in cps if p <= c and p < n], default=0)
    if live_ok and cut and c >= max(CUT_MIN, len(toks) // 2):
        return max(deepest, min(c, n - 1))
    return deepest


# tokens over a small alphabet, some long (past CUT_MIN) so that common-prefix cuts happen
_toks = hs.one_of(hs.lists(hs.integers(0, 2), min_size=1, max_size=8),
                  hs.tuples(hs.integers(0, 1), hs.integers(30, 40), hs.lists(hs.integers(0, 2), max_size=6))
                  .map(lambda t: [t[0]] * t[1] + t[2])).map(tuple)
_parked = hs.fixed_dictionaries({"toks": _toks, "tier": hs.sampled_from(["device", "ram", "disk"]),
                                 "last_use": hs.integers(0, 3), "live_ok": hs.booleans(), "cut": hs.booleans(),
                                 "gone": hs.booleans(), "cps": hs.lists(hs.integers(1, 45), max_size=3)})


@settings(max_examples=1000 if full_sweeps() else 300, deadline=None)     # CI 300, make test-sweeps 1,000
@given(parked=hs.lists(_parked, max_size=12), values=hs.lists(_toks, max_size=8), prompt=_toks)
def test_one_walk_finds_what_a_scan_of_every_prefix_finds(parked, values, prompt):
    tree = CheckpointTree()
    for v in values:
        tree.put(v, v)
    recs = {}
    for i, r in enumerate(parked):
        r = dict(r, cps=[p for p in r["cps"] if p <= len(r["toks"])], saved=i)
        conv = Conversation(tokens=np.array(r["toks"], np.int32), parts=[], live_ok=r["live_ok"],
                            last_use=float(r["last_use"]), cut_anywhere=r["cut"],
                            checkpoints=[SavedCheckpoint(p, "turn", []) for p in r["cps"]])
        p = Parked(conv, r["tier"], saved=i, file=SimpleNamespace(gone=r["gone"] and r["tier"] == "disk"))
        p.node, old = tree.put(r["toks"], p, "parked")
        if old is not None:
            del recs[id(old)]
        recs[id(p)] = (r, p)
    version = tree.version
    found = lookup(tree, prompt)
    assert tree.version == version and found.current(np.array(prompt, np.int32))

    n = len(prompt)
    want_cp = max((len(v) for v in values if len(v) < n and tuple(prompt[:len(v)]) == v), default=0)
    assert (found.checkpoint.pos if found.checkpoint is not None else 0) == want_cp
    assert found.checkpoint is None or found.checkpoint.value == tuple(prompt[:want_cp])

    cand = [((_depth(r, prompt), -TIER_RANK[r["tier"]], r["last_use"], r["saved"]), p) for r, p in recs.values()
            if not (r["tier"] == "disk" and r["gone"])]
    cand = [c for c in cand if c[0][0] > 0]
    want = max(cand, key=lambda c: c[0]) if cand else (None, None)
    assert found.parked is want[1]
    assert found.depth == (want[0][0] if cand else 0)
    assert [nd.pos for nd in found.path] == sorted({0} | {nd.pos for nd in found.path})
    for nd in found.path:
        assert tuple(nd.tokens().tolist()) == tuple(prompt[:nd.pos])
