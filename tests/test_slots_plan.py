"""The request slots' planning (strata/engine/slots.py), pure functions checked with hypothesis: a request's slot
(id_slot, else the longest shared prefix, else the least recently used idle slot), the chunks a prompt is read in
(depending only on its own positions), and the steps of continuous batching (every decoding slot each step, prefill
parts under the budget round-robin, a speculative verify counted as its tokens, a prompt's parts the same whatever
else runs, no slot starved)."""
import pytest
from hypothesis import given, settings, strategies as hs

from strata.engine.slots import SlotView, SlotWork, choose_slot, chunk_bounds, plan_step

toks = hs.lists(hs.integers(0, 3), max_size=12)
views = hs.lists(hs.tuples(toks, hs.integers(0, 20), hs.booleans()), min_size=1, max_size=6).map(
    lambda xs: [SlotView(i, tuple(t), float(u), b) for i, (t, u, b) in enumerate(xs)])


def _shared(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@settings(max_examples=2000, deadline=None)
@given(views, toks)
def test_choose_slot_longest_prefix_else_lru(slots, prompt):
    got = choose_slot(slots, prompt)
    idle = [s for s in slots if not s.busy]
    if not idle:
        assert got is None
        return
    pick = next(s for s in slots if s.id == got)
    assert not pick.busy
    best = max(_shared(s.tokens, prompt) for s in idle)
    assert _shared(pick.tokens, prompt) == best
    among = [s for s in idle if _shared(s.tokens, prompt) == best] if best else idle
    assert (pick.last_used, pick.id) == min((s.last_used, s.id) for s in among)


@settings(max_examples=300, deadline=None)
@given(views, toks, hs.integers(-2, 8))
def test_choose_slot_named(slots, prompt, want):
    if any(s.id == want for s in slots):
        assert choose_slot(slots, prompt, id_slot=want) == want
    else:
        with pytest.raises(ValueError, match="id_slot"):
            choose_slot(slots, prompt, id_slot=want)


@settings(max_examples=2000, deadline=None)
@given(hs.integers(0, 300), hs.integers(0, 300), hs.integers(1, 64), hs.lists(hs.integers(-5, 700), max_size=6))
def test_chunk_bounds_cover_and_cut(start, length, chunk, cuts):
    end = start + length
    parts = chunk_bounds(start, end, chunk, cuts)
    assert [p for q in parts for p in q][:1] in ([], [start])
    assert all(b > a and b - a <= chunk for a, b in parts)
    assert all(parts[i][1] == parts[i + 1][0] for i in range(len(parts) - 1))
    assert (parts[-1][1] if parts else start) == end
    inner = {c for c in cuts if start < c < end}
    assert inner <= {b for _, b in parts}
    for a, b in parts:
        assert b == end or b in inner or (b - start) % chunk == 0


def test_chunk_bounds_refuse():
    with pytest.raises(ValueError, match="chunk"):
        chunk_bounds(0, 10, 0)
    with pytest.raises(ValueError, match="ends before"):
        chunk_bounds(5, 4, 8)


def _run(requests, budget, steps=400):
    """Simulate steps: requests = {slot: (arrival step, prompt length, chunk, tokens to decode, verify size)}
    (verify size 0: one-token decodes, else each decode is a speculative verify of that many tokens); -> per slot
    the parts it read in order, the step its prompt ended and the steps it decoded."""
    work: dict[int, list] = {}
    left: dict[int, int] = {}
    read = {s: [] for s in requests}
    when = {s: [] for s in requests}
    decoded = {s: [] for s in requests}
    cursor = 0
    for t in range(steps):
        for s, (arr, n, chunk, m, v) in requests.items():
            if arr == t:
                work[s], left[s] = list(chunk_bounds(0, n, chunk)), m
        if not work:
            if all(arr < t for arr, *_ in requests.values()):
                break
            continue
        plan = plan_step([SlotWork(s, tuple(c), 0 if c else requests[s][4]) for s, c in sorted(work.items())],
                         budget, cursor)
        fixed = len(plan.decode) + sum(k for _, k in plan.verify)          # never deferred
        assert plan.tokens == fixed + sum(b - a for _, a, b in plan.prefill)
        assert len({s for s, _, _ in plan.prefill}) == len(plan.prefill)
        # every decoding slot, every step: a one-token read or its verify
        assert set(plan.decode) == {s for s, c in work.items() if not c and not requests[s][4]}
        assert dict(plan.verify) == {s: requests[s][4] for s, c in work.items() if not c and requests[s][4]}
        if plan.prefill:
            first = plan.prefill[0]
            assert plan.tokens <= budget or plan.tokens == fixed + first[2] - first[1]
        elif any(work.values()):
            raise AssertionError("a step with prefilling slots read no prompt part")
        cursor = plan.cursor
        for s, a, b in plan.prefill:
            assert work[s][0] == (a, b)
            read[s].append((a, b))
            when[s].append(t)
            work[s].pop(0)
        for s in plan.decode + tuple(s for s, _ in plan.verify):
            decoded[s].append(t)
            left[s] -= 1
            if left[s] == 0:
                del work[s]
    return read, decoded, when


reqs = hs.dictionaries(hs.integers(0, 5), hs.tuples(hs.integers(0, 6), hs.integers(1, 90), hs.integers(1, 32),
                                                   hs.integers(1, 6), hs.sampled_from([0, 0, 2, 4])),
                       min_size=1, max_size=5)


@settings(max_examples=400, deadline=None)
@given(reqs, hs.integers(1, 80))
def test_steps_read_each_prompt_in_its_own_parts_and_starve_none(requests, budget):
    read, decoded, when = _run(requests, budget)
    for s, (arr, n, chunk, m, _) in requests.items():
        assert read[s] == chunk_bounds(0, n, chunk), "the parts depend on other slots"
        assert len(decoded[s]) == m, f"slot {s} starved"
        assert decoded[s] == list(range(decoded[s][0], decoded[s][0] + m)), "a decoding slot skipped a step"
        # round-robin: a prefilling slot waits at most one step per other slot before its next part
        first = [arr] + when[s][:-1]
        assert all(b - a <= len(requests) for a, b in zip(first, when[s])), f"slot {s} waited too long"
    alone = {s: _run({s: r}, budget)[0][s] for s, r in requests.items()}
    assert alone == read


def test_plan_step_refuses():
    with pytest.raises(ValueError, match="budget"):
        plan_step([SlotWork(0)], 0)
    with pytest.raises(ValueError, match="repeat"):
        plan_step([SlotWork(0), SlotWork(0)], 8)
    with pytest.raises(ValueError, match="slot 1: a verify"):
        plan_step([SlotWork(0), SlotWork(1, ((0, 4),), verify=3)], 8)
    with pytest.raises(ValueError, match="slot 0: a verify"):
        plan_step([SlotWork(0, verify=-1)], 8)


def test_a_verify_counts_its_tokens_against_the_budget():
    """Two slots verifying 4 tokens each and one decoding leave 16 - 9 = 7 tokens of the budget: a prompt part of 6
    runs beside them, one of 8 waits behind the first (which runs whatever is left)."""
    plan = plan_step([SlotWork(0, verify=4), SlotWork(1), SlotWork(2, verify=4), SlotWork(3, ((0, 6),)),
                      SlotWork(4, ((0, 8),))], 16)
    assert plan.decode == (1,) and plan.verify == ((0, 4), (2, 4)) and plan.prefill == ((3, 0, 6),)
    assert plan.tokens == 15

@settings(max_examples=2000, deadline=None)
@given(hs.data())
def test_assign_sets_keeps_homes_and_never_shares(data):
    """The CUDA batched step's running-state sets (strata/backend/cuda/batch.assign_sets, pure): a row resident in
    a set keeps it, rows get distinct sets, a new row takes an idle set before a busy one and new sets last."""
    from strata.backend.cuda.batch import assign_sets
    busy = data.draw(hs.lists(hs.booleans(), max_size=8))
    n = data.draw(hs.integers(1, 10))
    homes_pool = data.draw(hs.permutations(list(range(len(busy))))) if busy else []
    homes = [homes_pool[i] if i < len(homes_pool) and data.draw(hs.booleans()) else None for i in range(n)]
    got = assign_sets(homes, busy)
    assert len(got) == n and len(set(got)) == n
    assert all(g == h for g, h in zip(got, homes) if h is not None)
    taken = {h for h in homes if h is not None}
    free = [k for k in range(len(busy)) if k not in taken]
    new = [g for g, h in zip(got, homes) if h is None]
    used_old = [g for g in new if g < len(busy)]
    assert all(g in free for g in used_old)
    order = sorted(free, key=lambda k: (busy[k], k))            # idle first, then by index
    assert used_old == order[:len(used_old)]
    assert [g for g in new if g >= len(busy)] == list(range(len(busy), len(busy) + len(new) - len(used_old)))
