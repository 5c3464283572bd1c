"""The checkpoint tree (strata.cache.tree): put / path / remove against a plain list of kept prefixes."""
from __future__ import annotations

from hypothesis import given, settings, strategies as hs

from strata.cache.tree import CheckpointTree


def _is_prefix(a, b) -> bool:
    return len(a) <= len(b) and list(b[:len(a)]) == list(a)


@settings(max_examples=300, deadline=None)
@given(ops=hs.lists(hs.tuples(hs.booleans(), hs.lists(hs.integers(0, 3), min_size=1, max_size=7)), max_size=30),
       probe=hs.lists(hs.integers(0, 3), max_size=8))
def test_tree_matches_a_list_of_prefixes(ops, probe):
    tree, ref, nodes = CheckpointTree(), {}, {}
    for add, toks in ops:
        key = tuple(toks)
        if add:
            node, old = tree.put(toks, key)
            assert old == (key if key in ref else None)
            ref[key], nodes[key] = key, node
        elif key in ref:
            assert tree.remove(nodes.pop(key)) == key
            del ref[key]
        assert len(tree) == len(ref)
        assert sorted(tuple(n.tokens().tolist()) for n in tree.nodes()) == sorted(ref)
        for k, n in nodes.items():
            assert tuple(n.tokens().tolist()) == k and n.value == k and n.pos == len(k)
    want = sorted((k for k in ref if _is_prefix(k, probe)), key=len)
    assert [n.value for n in tree.path(probe)] == want
    leaves = [k for k in ref if not any(o != k and _is_prefix(k, o) for o in ref)]
    assert tree.branches() == len(leaves)


@settings(max_examples=300, deadline=None)
@given(ops=hs.lists(hs.tuples(hs.sampled_from(["value", "parked"]), hs.booleans(),
                              hs.lists(hs.integers(0, 3), min_size=1, max_size=7)), max_size=40),
       probe=hs.lists(hs.integers(0, 3), max_size=8))
def test_two_slots_are_kept_apart_in_one_tree(ops, probe):
    """Checkpoints and parked conversations at the same prefixes: each slot answers as a tree of its own would."""
    tree = CheckpointTree()
    ref = {"value": {}, "parked": {}}
    nodes = {"value": {}, "parked": {}}
    for slot, add, toks in ops:
        key = tuple(toks)
        if add:
            node, old = tree.put(toks, (slot, key), slot)
            assert old == ((slot, key) if key in ref[slot] else None)
            ref[slot][key], nodes[slot][key] = (slot, key), node
        elif key in ref[slot]:
            assert tree.remove(nodes[slot].pop(key), slot) == (slot, key)
            del ref[slot][key]
        for s in ref:
            assert tree.count(s) == len(ref[s])
            assert sorted(tuple(n.tokens().tolist()) for n in tree.nodes(s)) == sorted(ref[s])
            for k, n in nodes[s].items():
                assert tuple(n.tokens().tolist()) == k and getattr(n, s) == (s, k)
    for s in ref:
        want = sorted((k for k in ref[s] if _is_prefix(k, probe)), key=len)
        assert [getattr(n, s)[1] for n in tree.path(probe, s)] == want
        leaves = [k for k in ref[s] if not any(o != k and _is_prefix(k, o) for o in ref[s])]
        assert tree.branches(s) == len(leaves)
        found = tree.find(probe)
        assert (found is not None and getattr(found, s) is not None) == (tuple(probe) in ref[s])
    for s in ref:                                   # forgetting everything leaves the bare root
        for k in list(nodes[s]):
            tree.remove(nodes[s].pop(k), s)
    assert not tree.root.children
