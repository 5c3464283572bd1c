"""Retention (strata.cache.retention): the one eviction pass (evict) and the checkpoint policy (choose_victims):
scenarios and property tests."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strata.cache.retention import Item, Kept, choose_victims, evict, pinned_root


def chain(*specs):
    """Kept checkpoints from (pos, last_use[, bytes]) tuples; saved = order given."""
    out = []
    for i, s in enumerate(specs):
        pos, last = s[0], s[1]
        out.append(Kept(pos=pos, kind="root" if i == 0 else "turn", last_use=last,
                        bytes=s[2] if len(s) > 2 else 100, saved=i + 1))
    return out


def kept_after(kept, **kw):
    victims = set(choose_victims(kept, **kw))
    return sorted(k.pos for k in kept if k.pos not in victims)


def test_under_cap_nothing_evicted():
    assert choose_victims(chain((100, 1), (200, 2)), cap=6) == []


def test_root_never_a_victim_even_when_least_recently_used():
    # root saved first and never used since: plain LRU would evict it first
    kept = chain((1000, 1), (1100, 2), (1200, 3), (1300, 4))
    assert choose_victims(kept, cap=3) == [1100]
    assert choose_victims(kept, cap=2) == [1100, 1200]
    assert kept_after(kept, cap=2) == [1000, 1300]


def test_root_is_the_shallowest_point_not_the_first_listed():
    kept = [Kept(pos=300, kind="turn", last_use=1, bytes=0, saved=1),
            Kept(pos=50, kind="root", last_use=2, bytes=0, saved=2),
            Kept(pos=400, kind="turn", last_use=3, bytes=0, saved=3)]
    assert pinned_root(kept, cap=2, root_min=0).pos == 50
    assert choose_victims(kept, cap=2) == [300]


def test_lru_rotation_by_last_use_not_save_order():
    # 1200 was saved before 1300 but mounted later (re-dated): 1300 is now the least recent
    kept = chain((1000, 1), (1100, 2), (1200, 9), (1300, 4), (1400, 5))
    assert choose_victims(kept, cap=3) == [1100, 1300]


def test_mount_re_dates_a_checkpoint():
    kept = chain((1000, 1), (1100, 2), (1200, 3), (1300, 4))
    assert choose_victims(kept, cap=3) == [1100]
    # mounting 1100 gives it the newest logical time: the next victim is 1200
    redated = [k if k.pos != 1100 else Kept(k.pos, k.kind, 10, k.bytes, k.saved) for k in kept]
    assert choose_victims(redated, cap=3) == [1200]


def test_cap_1_is_fifo_without_pin():
    kept = chain((1000, 1), (1100, 5))
    assert pinned_root(kept, cap=1, root_min=0) is None
    assert choose_victims(kept, cap=1) == [1000]          # the root goes: the old behaviour
    # FIFO: by save order, even if the older one was used more recently
    kept = [Kept(pos=1000, kind="root", last_use=9, bytes=0, saved=1),
            Kept(pos=1100, kind="turn", last_use=2, bytes=0, saved=2)]
    assert choose_victims(kept, cap=1) == [1000]


def test_cap_guard_below_two_never_pins():
    kept = chain((1000, 1), (1100, 2), (1200, 3))
    assert pinned_root(kept, cap=1, root_min=0) is None
    assert pinned_root(kept, cap=0, root_min=0) is None
    assert pinned_root(kept, cap=2, root_min=0).pos == 1000


def test_cap_0_keeps_none():
    kept = chain((1000, 1), (1100, 2))
    assert sorted(choose_victims(kept, cap=0)) == [1000, 1100]
    assert choose_victims([], cap=0) == []


def test_root_min_unpins_a_short_root():
    kept = chain((60, 1), (1100, 2), (1200, 3))
    assert pinned_root(kept, cap=2, root_min=64) is None
    assert choose_victims(kept, cap=2, root_min=64) == [60]
    assert choose_victims(kept, cap=2, root_min=60) == [1100]


def test_byte_budget_evicts_lru_first_then_the_root():
    kept = chain((1000, 1, 400), (1100, 2, 300), (1200, 3, 300), (1300, 4, 300))
    assert choose_victims(kept, cap=6, budget_bytes=1300) == []
    assert choose_victims(kept, cap=6, budget_bytes=1000) == [1100]
    assert choose_victims(kept, cap=6, budget_bytes=700) == [1100, 1200]
    assert choose_victims(kept, cap=6, budget_bytes=400) == [1100, 1200, 1300]
    # the pinned root alone exceeds the budget: it goes too (a hard cap)
    assert sorted(choose_victims(kept, cap=6, budget_bytes=399)) == [1000, 1100, 1200, 1300]
    assert choose_victims(kept, cap=6, budget_bytes=None) == []


def test_bad_input_is_refused():
    kept = chain((1000, 1))
    with pytest.raises(ValueError, match="cap"):
        choose_victims(kept, cap=-1)
    with pytest.raises(ValueError, match="root_min"):
        choose_victims(kept, cap=2, root_min=-5)
    with pytest.raises(ValueError, match="budget"):
        choose_victims(kept, cap=2, budget_bytes=-1)
    with pytest.raises(ValueError, match="unique"):
        choose_victims(chain((10, 1), (10, 2)), cap=2)
    with pytest.raises(ValueError, match="> 0"):
        choose_victims([Kept(0, "root", 1, 0)], cap=2)


def test_pure_input_unchanged():
    kept = chain((1000, 1), (1100, 2), (1200, 3))
    before = list(kept)
    choose_victims(kept, cap=1, budget_bytes=50)
    assert kept == before


@st.composite
def chains(draw):
    n = draw(st.integers(0, 12))
    positions = sorted(draw(st.sets(st.integers(1, 100_000), min_size=n, max_size=n)))
    uses = draw(st.permutations(list(range(1, n + 1))))
    sizes = draw(st.lists(st.integers(0, 1000), min_size=n, max_size=n))
    saved = draw(st.permutations(list(range(1, n + 1))))
    return [Kept(p, "turn", u, b, s) for p, u, b, s in zip(positions, uses, sizes, saved)]


@settings(max_examples=300, deadline=None)
@given(kept=chains(), cap=st.integers(0, 8), root_min=st.integers(0, 100_000),
       budget=st.one_of(st.none(), st.integers(0, 6000)))
def test_properties(kept, cap, root_min, budget):
    victims = choose_victims(kept, cap=cap, root_min=root_min, budget_bytes=budget)
    assert len(victims) == len(set(victims))
    assert set(victims) <= {k.pos for k in kept}
    left = [k for k in kept if k.pos not in set(victims)]
    # never more than cap kept; the budget holds
    assert len(left) <= cap
    if budget is not None:
        assert sum(k.bytes for k in left) <= budget
    # minimal: nothing is evicted when the limits already hold
    if len(kept) <= cap and (budget is None or sum(k.bytes for k in kept) <= budget):
        assert victims == []
    # the root is kept when eligible (cap >= 2, long enough, fits the budget alone)
    if kept and cap >= 2:
        root = min(kept, key=lambda k: k.pos)
        if root.pos >= root_min and (budget is None or root.bytes <= budget):
            assert root.pos not in victims
    # among unpinned checkpoints the victims are the least recently used ones (cap >= 2)
    if cap >= 2 and victims:
        pin = pinned_root(kept, cap, root_min)
        unpinned_left = [k for k in left if k is not pin]
        unpinned_gone = [k for k in kept if k.pos in set(victims) and k is not pin]
        if unpinned_left and unpinned_gone:
            assert max(k.last_use for k in unpinned_gone) < min(k.last_use for k in unpinned_left)


def test_branches_at_one_position_are_told_apart_by_their_keys():
    # two sub-agents' turns at the same position on one root: the LRU one goes, named by its key
    kept = [Kept(pos=40, kind="root", last_use=1, bytes=0, saved=1, key=7),
            Kept(pos=52, kind="turn", last_use=2, bytes=0, saved=2, key=8),
            Kept(pos=52, kind="turn", last_use=3, bytes=0, saved=3, key=9)]
    assert pinned_root(kept, cap=2, root_min=0).key == 7
    assert choose_victims(kept, cap=2) == [8]
    with pytest.raises(ValueError, match="unique"):
        choose_victims(kept + [Kept(pos=60, kind="turn", last_use=4, bytes=0, saved=4, key=9)], cap=2)


def test_held_checkpoints_are_outside_the_count_and_move_last_for_the_bytes():
    # a parked conversation holds 150 and 300: the cap of 2 counts 100 (the root), 200 and 400 only
    kept = [Kept(100, "root", 5, 100, 1), Kept(150, "turn", 1, 100, 2, held=True), Kept(200, "turn", 2, 100, 3),
            Kept(300, "turn", 3, 100, 4, held=True), Kept(400, "turn", 4, 100, 5)]
    assert choose_victims(kept, cap=2) == [200]
    assert choose_victims(kept, cap=0) == [100, 200, 400]
    assert choose_victims(kept, cap=1) == [100, 200]
    # bytes: the unheld least recently used first, the root, then the held ones least recently used first
    assert choose_victims(kept, cap=5, budget_bytes=300) == [200, 400]
    assert choose_victims(kept, cap=5, budget_bytes=100) == [200, 400, 100, 150]
    assert choose_victims(kept, cap=2, budget_bytes=0) == [200, 400, 100, 150, 300]


@settings(max_examples=300, deadline=None)
@given(kept=chains(), held=st.lists(st.booleans(), min_size=12, max_size=12), cap=st.integers(0, 8),
       budget=st.one_of(st.none(), st.integers(0, 6000)))
def test_held_properties(kept, held, cap, budget):
    kept = [Kept(k.pos, k.kind, k.last_use, k.bytes, k.saved, held=h) for k, h in zip(kept, held)]
    victims = choose_victims(kept, cap=cap, budget_bytes=budget)
    left = [k for k in kept if k.pos not in set(victims)]
    assert len([k for k in left if not k.held]) <= cap                  # the cap counts the unheld
    if budget is None:
        assert all(not k.held for k in kept if k.pos in set(victims))   # the count never takes a held one
    else:
        assert sum(k.bytes for k in left) <= budget
        # a held one goes only once every unheld one is gone
        if any(k.held for k in kept if k.pos in set(victims)):
            assert all(k.held for k in left)
    unheld = choose_victims([k for k in kept if not k.held], cap=cap)
    if budget is None:
        assert victims == unheld                                        # the held ones change nothing else


def test_one_pass_over_a_tier_orders_both_kinds_by_last_use_each_against_its_budget():
    """evict: checkpoints and parked conversations of one tier in one pass, least recently used first, each item
    going only while a budget it counts in is over; a later stage goes after every earlier one."""
    items = [Item(("c", 1), (1.0,), {"ckpt": 10}), Item(("p", 1), (2.0,), {"conv": 50}),
             Item(("c", 2), (3.0,), {"ckpt": 10}), Item(("p", 2), (4.0,), {"conv": 50}),
             Item(("c", 3), (0.5,), {"ckpt": 10}, stage=2)]
    assert evict(items, {"ckpt": 20, "conv": 50}) == [(("c", 1), frozenset({"ckpt"})),
                                                      (("p", 1), frozenset({"conv"}))]
    assert evict(items, {"ckpt": 0, "conv": None}) == [(k, frozenset({"ckpt"})) for k in
                                                       (("c", 1), ("c", 2), ("c", 3))]
    assert evict(items, {}) == []                       # no budget named: no limit
    with pytest.raises(ValueError, match="budget ckpt"):
        evict(items, {"ckpt": -1})
    with pytest.raises(ValueError, match="two items"):
        evict(items + items[:1], {"ckpt": 1})


@settings(max_examples=200, deadline=None)
@given(a=st.lists(st.integers(0, 100), max_size=8), b=st.lists(st.integers(0, 100), max_size=8),
       ba=st.one_of(st.none(), st.integers(0, 400)), bb=st.one_of(st.none(), st.integers(0, 400)),
       order=st.randoms(use_true_random=False))
def test_one_pass_is_each_budget_alone(a, b, ba, bb, order):
    """Two kinds each against a budget of its own: the one pass evicts exactly what a pass over each kind alone
    would, in last-use order."""
    uses = list(range(len(a) + len(b)))
    order.shuffle(uses)
    items = [Item(("a", i), (uses[i],), {"A": c}) for i, c in enumerate(a)] + \
            [Item(("b", i), (uses[len(a) + i],), {"B": c}) for i, c in enumerate(b)]
    both = [k for k, _ in evict(items, {"A": ba, "B": bb})]
    alone = [k for k, _ in evict([i for i in items if i.key[0] == "a"], {"A": ba})] + \
            [k for k, _ in evict([i for i in items if i.key[0] == "b"], {"B": bb})]
    assert sorted(both) == sorted(alone)
    assert [dict((i.key, i.order) for i in items)[k] for k in both] == \
        sorted(dict((i.key, i.order) for i in items)[k] for k in both)
