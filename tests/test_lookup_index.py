"""NgramIndex (strata.sampling.lookup) against a brute-force search over the whole sequence: after any mix of appends
(short and long, so both ways of linking run) and cuts back, the proposal is the one the definition gives."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as hs

from strata.sampling.lookup import NgramIndex


def brute(toks: list[int], n_min: int, n_max: int, hops: int, reach: int, k: int) -> list[int]:
    """The definition: the longest n (n_max..n_min) whose last-n tokens occurred before with a known next token;
    among its `hops` most recent occurrences the one whose preceding text agrees longest (up to reach; the most
    recent among equals); k tokens copied from after it, past the end from the proposal itself."""
    N = len(toks)
    for n in range(min(n_max, N - 1), n_min - 1, -1):
        tail = toks[N - n:]
        occ = [e for e in range(N - 1, n - 1, -1) if toks[e - n:e] == tail][:hops]
        if not occ:
            continue

        def agree(e):
            c = 0
            while c < min(reach, e - n) and toks[e - n - 1 - c] == toks[N - n - 1 - c]:
                c += 1
            return c
        best = max(occ, key=lambda e: (agree(e), e))
        out = []
        ext = list(toks)
        for i in range(k):
            ext.append(ext[best + i])
            out.append(ext[best + i])
        return out
    return []


ops = hs.lists(hs.one_of(
    hs.tuples(hs.just("add"), hs.lists(hs.integers(0, 3), min_size=1, max_size=6)),
    hs.tuples(hs.just("bulk"), hs.lists(hs.integers(0, 5), min_size=48, max_size=120)),
    hs.tuples(hs.just("cut"), hs.integers(0, 200))), min_size=1, max_size=12)


@settings(max_examples=200, deadline=None)
@given(ops=ops, n_min=hs.integers(1, 3), extra=hs.integers(0, 3), hops=hs.integers(1, 4),
       reach=hs.integers(0, 6), k=hs.integers(1, 6))
def test_proposals_equal_brute_force(ops, n_min, extra, hops, reach, k):
    idx = NgramIndex(n_min, n_min + extra, hops=hops, reach=reach)
    seq: list[int] = []
    for op, arg in ops:
        if op == "cut":
            seq = seq[:arg]
            idx.truncate(arg)
        else:
            seq += arg
            idx.extend(arg)
        assert idx.tokens.tolist() == seq
        assert idx.propose(k) == brute(seq, n_min, n_min + extra, hops, reach, k)


@settings(max_examples=60, deadline=None)
@given(toks=hs.lists(hs.integers(0, 4), min_size=0, max_size=150), cut=hs.integers(0, 150))
def test_chains_after_cut_equal_chains_built_fresh(toks, cut):
    """Cutting back leaves exactly the chains an index built from the kept tokens alone has (nothing stale)."""
    a, b = NgramIndex(1, 3), NgramIndex(1, 3)
    a.extend(toks)
    a.truncate(cut)
    b.extend(toks[:cut])
    for n in a.head:
        assert a.head[n] == b.head[n]
        assert a.prev[n][:len(a)].tolist() == b.prev[n][:len(b)].tolist()
        assert (a.prev[n][len(a):] == -1).all()
    assert a.common_prefix(toks) == len(a)


def test_copying_finds_the_right_place():
    """Code-like text whose short n-grams recur: the occurrence with the longest agreeing past is proposed."""
    rng = np.random.default_rng(0)
    body = rng.integers(0, 50, 400).tolist()
    idx = NgramIndex(2, 4, hops=8, reach=64)
    idx.extend(body + [7, 8] + body[:200])         # a copy of the body in progress
    assert idx.propose(10) == body[200:210]
    assert NgramIndex(2, 2).propose(3) == []
    with pytest.raises(ValueError, match="n_min"):
        NgramIndex(3, 2)
