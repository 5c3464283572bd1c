"""The expert tier's swap policy (strata/moe/policy.py) alone: its invariants over random usage, resident sets and
dwell times (hypothesis), and the choices it must make on small hand-made cases."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strata.moe.policy import Policy, Swap, decayed, hottest, plan_swaps
from tests.helpers import full_sweeps


@st.composite
def rounds(draw):
    n = draw(st.integers(1, 40))
    usage = np.asarray(draw(st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.0, 7.5, 20.0, 100.0]),
                                     min_size=n, max_size=n)))
    budget = draw(st.integers(0, n + 2))
    n_res = draw(st.integers(0, min(n, budget)))
    resident = np.zeros(n, dtype=bool)
    resident[draw(st.permutations(range(n)))[:n_res]] = True
    dwell = np.asarray(draw(st.lists(st.integers(0, 200), min_size=n, max_size=n)))
    pol = Policy(every=1, swaps=draw(st.integers(0, 8)), min_dwell=draw(st.integers(0, 150)),
                 margin=draw(st.sampled_from([0.0, 0.1, 0.5, 2.0])))
    cap = draw(st.one_of(st.none(), st.integers(0, 8)))
    return usage, resident, dwell, budget, pol, cap


@settings(max_examples=2000 if full_sweeps() else 500, deadline=None)    # make test-sweeps: 2,000
@given(rounds())
def test_policy_invariants(case):
    """Budget never exceeded, no expert both in and out or twice, ins non-resident and used, outs resident and past
    their dwell, each swap out only for a hotter expert by the margin, at most the cap, the same answer twice."""
    usage, resident, dwell, budget, pol, cap = case
    swaps = plan_swaps(usage, resident, dwell, budget, pol, cap)
    assert swaps == plan_swaps(usage.copy(), resident.copy(), dwell.copy(), budget, pol, cap)
    assert sum(s.out is not None for s in swaps) <= pol.swaps
    assert cap is None or len(swaps) <= cap
    ins = [s.into for s in swaps]
    outs = [s.out for s in swaps if s.out is not None]
    assert len(set(ins)) == len(ins) and len(set(outs)) == len(outs)
    assert not set(ins) & set(outs)
    for s in swaps:
        assert not resident[s.into] and usage[s.into] > 0
        if s.out is not None:
            assert resident[s.out] and dwell[s.out] >= pol.min_dwell
            assert usage[s.into] > usage[s.out] * (1 + pol.margin) and usage[s.into] >= usage[s.out] + 1
    after = resident.copy()
    after[outs] = False
    after[ins] = True
    assert after.sum() <= max(budget, resident.sum())
    # free slots are filled before anything is evicted
    n_free_ins = sum(s.out is None for s in swaps)
    assert n_free_ins == min(len(swaps), max(0, budget - int(resident.sum())), len(swaps))
    if any(s.out is not None for s in swaps):
        assert resident.sum() + n_free_ins == budget


@settings(max_examples=500, deadline=None)
@given(rounds())
def test_policy_converges_to_the_hottest(case):
    """Rounds repeated on fixed usage (dwell always past the minimum, no margin) end with the hottest experts resident
    (up to ties), and then stop swapping."""
    usage, resident, _, budget, pol, _ = case
    pol = Policy(every=1, swaps=max(1, pol.swaps), min_dwell=0, margin=0.0)
    res = resident.copy()
    for _ in range(len(usage) * 2 + 2):
        swaps = plan_swaps(usage, res, np.zeros(len(usage), int), budget, pol)
        if not swaps:
            break
        for s in swaps:
            if s.out is not None:
                res[s.out] = False
            res[s.into] = True
    assert not plan_swaps(usage, res, np.zeros(len(usage), int), budget, pol)
    b = min(budget, len(usage))
    if res.sum() and (~res).sum():
        # no non-resident expert is hotter than a resident one by a whole count
        assert usage[~res].max() < usage[res].min() + 1 or res.sum() < b


def test_hot_newcomer_replaces_the_coldest_after_its_dwell():
    pol = Policy(every=8, swaps=2, min_dwell=10, margin=0.5)
    usage = np.array([5.0, 1.0, 9.0, 0.0, 30.0])
    assert plan_swaps(np.array([5.0, 1.0, 9.0, 3.0, 30.0]), np.array([True, True, False, False, False]),
                      np.array([50, 50, 0, 0, 0]), 2, pol) == [Swap(4, 1), Swap(2, 0)]     # --adapt-swaps 2
    resident = np.array([True, True, False, False, False])
    dwell = np.array([50, 50, 0, 0, 0])
    assert plan_swaps(usage, resident, dwell, 2, pol) == [Swap(4, 1), Swap(2, 0)]
    # the coldest has not dwelt long enough: the next coldest goes
    assert plan_swaps(usage, resident, np.array([50, 3, 0, 0, 0]), 2, pol) == [Swap(4, 0)]
    # the margin holds a near tie back
    assert plan_swaps(np.array([5.0, 1.0, 1.4, 0.0, 0.0]), resident, dwell, 2, pol) == []
    # free slots first, hottest first, more than --adapt-swaps of them, capped by the copy rate only
    assert plan_swaps(usage, np.zeros(5, bool), np.zeros(5, int), 3, pol) == [Swap(4, None), Swap(2, None),
                                                                               Swap(0, None)]
    assert plan_swaps(usage, np.zeros(5, bool), np.zeros(5, int), 3, pol, max_swaps=1) == [Swap(4, None)]


def test_decay_and_static_placement():
    pol = Policy(half_life=4)
    assert pol.decay(4) == pytest.approx(0.5) and pol.decay(0) == 1.0
    np.testing.assert_allclose(decayed(np.array([8.0, 2.0]), np.array([1, 0]), pol.decay(8)), [3.0, 0.5])
    assert hottest(np.array([1.0, 5.0, 5.0, 0.0]), 3).tolist() == [1, 2, 0]


@pytest.mark.parametrize("kw,flag", [({"every": 0}, "--adapt-every"), ({"swaps": -1}, "--adapt-swaps"),
                                     ({"half_life": 0}, "half_life")])
def test_policy_problems_name_the_flag(kw, flag):
    assert flag in Policy(**kw).problem()
    assert Policy().problem() is None
