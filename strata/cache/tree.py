"""CheckpointTree: the kept checkpoints as a prefix tree over token spans, many branches at once (sub-agents on one
system prompt, regenerations, edited turns)."""
from __future__ import annotations

from typing import Any, Iterator

import numpy as np

from strata.text.token_ids import as_ids, common_prefix

__all__ = ["CheckpointTree", "Node"]

_EMPTY = np.zeros(0, np.int32)


class Node:
    """One node: the token ids ``span`` that follow its parent's end (a node ends at ``pos`` = the parent's pos +
    len(span)), its children by their first token, and ``value``: what is kept there (a checkpoint entry) or None
    for a branch point only (two branches part there)."""

    __slots__ = ("parent", "span", "pos", "children", "value")

    def __init__(self, parent: "Node | None", span: np.ndarray, value: Any = None):
        self.parent, self.span, self.value = parent, span, value
        self.pos = (parent.pos if parent is not None else 0) + int(span.shape[0])
        self.children: dict[int, Node] = {}

    def tokens(self) -> np.ndarray:
        """The token ids from position 0 to this node's end (a new array)."""
        spans, n = [], self
        while n is not None:
            spans.append(n.span)
            n = n.parent
        return np.concatenate(spans[::-1]) if len(spans) > 1 else _EMPTY.copy()


class CheckpointTree:
    """Values (checkpoint entries) kept at token prefixes, in a prefix tree whose edges are token spans: a lookup
    walks the tokens of a prompt once, comparing whole spans with numpy. ``put`` keeps a value at a prefix
    (returning the one it replaces), ``remove`` forgets one (a branch point left with one child is merged away),
    ``path`` gives the nodes with a value along a prompt. Not thread-safe (its owner locks)."""

    def __init__(self):
        self.root = Node(None, _EMPTY)
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def _walk(self, ids: np.ndarray) -> Iterator[Node]:
        """The nodes whose whole prefix is a prefix of `ids`, from the root down (the root first)."""
        node, n = self.root, int(ids.shape[0])
        yield node
        while node.pos < n:
            child = node.children.get(int(ids[node.pos]))
            if child is None or child.pos > n or common_prefix(child.span, ids[node.pos:child.pos]) < child.span.shape[0]:
                return
            node = child
            yield node

    def path(self, tokens) -> list[Node]:
        """The nodes that keep a value and whose prefix is a prefix of `tokens`, shallowest first."""
        return [n for n in self._walk(as_ids(tokens)) if n.value is not None]

    def put(self, tokens, value: Any) -> tuple[Node, Any]:
        """Keep `value` at the prefix `tokens` (non-empty) -> (its node, the value it replaced or None)."""
        ids = as_ids(tokens)
        n = int(ids.shape[0])
        if n == 0:
            raise ValueError("a checkpoint keeps at least one token")
        node = self.root
        while True:
            if node.pos == n:
                old, node.value = node.value, value
                self._n += old is None
                return node, old
            child = node.children.get(int(ids[node.pos]))
            if child is None:                                   # a new branch from here
                leaf = Node(node, ids[node.pos:].copy(), value)
                node.children[int(ids[node.pos])] = leaf
                self._n += 1
                return leaf, None
            k = common_prefix(child.span, ids[node.pos:min(n, child.pos)])
            if k == child.span.shape[0]:
                node = child
                continue
            mid = Node(node, child.span[:k].copy())             # the branches part at node.pos + k: split the span
            node.children[int(child.span[0])] = mid
            child.span, child.parent = child.span[k:].copy(), mid
            mid.children[int(child.span[0])] = child
            node = mid

    def remove(self, node: Node) -> Any:
        """Forget the value kept at `node` -> it; the node goes when nothing is kept below it, and a branch point
        left with one child is merged into it."""
        old, node.value = node.value, None
        self._n -= old is not None
        while node is not self.root and node.value is None and len(node.children) <= 1:
            parent = node.parent
            if not node.children:
                del parent.children[int(node.span[0])]
            else:
                (child,) = node.children.values()
                child.span = np.concatenate([node.span, child.span])
                child.parent = parent
                parent.children[int(node.span[0])] = child
            node = parent
        return old

    def nodes(self) -> list[Node]:
        """Every node that keeps a value, by position."""
        out, stack = [], [self.root]
        while stack:
            n = stack.pop()
            if n.value is not None:
                out.append(n)
            stack.extend(n.children.values())
        return sorted(out, key=lambda n: n.pos)

    def branches(self) -> int:
        """Leaves: how many branches of history are kept."""
        return sum(1 for n in self.nodes() if not n.children)
