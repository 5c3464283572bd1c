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


@settings(max_examples=150, deadline=None)
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


class _Seq:
    """What LookupDrafter reads of a Sequence: ids, pos and an epoch moved by every change that is not a read."""

    def __init__(self):
        self.buf: list[int] = []
        self.epoch = 0

    @property
    def ids(self):
        return np.asarray(self.buf, np.int32)

    @property
    def pos(self):
        return len(self.buf)


@settings(max_examples=150, deadline=None)
@given(ops=hs.lists(hs.one_of(
    hs.tuples(hs.just("read"), hs.lists(hs.integers(0, 3), min_size=1, max_size=60)),
    hs.tuples(hs.just("commit_drafts"), hs.integers(0, 3)),
    hs.tuples(hs.just("cut"), hs.integers(0, 80)),
    hs.tuples(hs.just("restore"), hs.lists(hs.integers(0, 3), max_size=80)),
    hs.tuples(hs.just("draft"), hs.integers(0, 3))), max_size=25))
def test_drafter_index_follows_the_sequence(ops):
    """LookupDrafter's index holds exactly the sequence's tokens and the token about to be read at every draft,
    whatever happened since the last one: reads, a verify's tokens read and committed back, cuts and restores (the
    epoch moved), the token drafted from never read; its drafts are the brute-force search's."""
    from strata.engine.lookup import LookupDrafter
    seq = _Seq()
    d = LookupDrafter(seq, 1, 3)
    for op, arg in ops:
        if op == "read":
            seq.buf += arg
        elif op == "commit_drafts":          # a verify of [t, d1, d2] read then committed to one past t
            seq.buf += [arg, 1, 2]
            del seq.buf[len(seq.buf) - 2:]
        elif op == "cut":
            del seq.buf[arg:]
            seq.epoch += 1
        elif op == "restore":
            seq.buf = list(arg)
            seq.epoch += 1
        else:
            got = [x.token for x in d.draft(arg, 4)]
            assert d.index.tokens.tolist() == seq.buf + [arg]
            assert got == brute(seq.buf + [arg], 1, 3, d.index.hops, d.index.reach, 4)
