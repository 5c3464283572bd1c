"""CheckpointTree: the prefix tree over token spans that keeps the engine's conversation state at token prefixes (the
checkpoints and the parked conversations, a slot each), many branches at once (sub-agents on one system prompt,
regenerations, edited turns), and the lock its keepers share."""
from __future__ import annotations

import threading
from typing import Any, Callable, Iterator

import numpy as np

from strata.text.token_ids import as_ids, common_prefix

__all__ = ["CheckpointTree", "Node", "SLOTS"]

_EMPTY = np.zeros(0, np.int32)
#: what a node can keep: "value" (a checkpoint entry, strata.cache.checkpoints) and "parked" (a parked
#: conversation, strata.cache.parked), each slot with its own keeper
SLOTS = ("value", "parked")
#: seconds a reader of a view waits for the lock before it takes the view published last (CheckpointTree.view)
VIEW_WAIT = 0.02


class Node:
    """One node: the token ids ``span`` that follow its parent's end (a node ends at ``pos`` = the parent's pos +
    len(span)), its children by their first token, and what is kept at its end, one slot each (SLOTS): ``value`` (a
    checkpoint entry) and ``parked`` (a parked conversation); a node with neither is a branch point only (two
    branches part there). ``pins``: how many parked conversations reference its checkpoint (CheckpointTree.pin):
    retention never evicts a pinned checkpoint, it only moves it down a tier."""

    __slots__ = ("parent", "span", "pos", "children", "value", "parked", "pins")

    def __init__(self, parent: "Node | None", span: np.ndarray, value: Any = None, slot: str = "value"):
        self.parent, self.span, self.value, self.parked, self.pins = parent, span, None, None, 0
        setattr(self, slot, value)
        self.pos = (parent.pos if parent is not None else 0) + int(span.shape[0])
        self.children: dict[int, Node] = {}

    def empty(self) -> bool:
        return self.value is None and self.parked is None

    def tokens(self) -> np.ndarray:
        """The token ids from position 0 to this node's end (a new array)."""
        spans, n = [], self
        while n is not None:
            spans.append(n.span)
            n = n.parent
        return np.concatenate(spans[::-1]) if len(spans) > 1 else _EMPTY.copy()


def _check_slot(slot: str) -> None:
    if slot not in SLOTS:
        raise ValueError(f"unknown tree slot {slot!r} (expected one of {', '.join(SLOTS)})")


class CheckpointTree:
    """Values kept at token prefixes, one per slot (SLOTS) and prefix, in a prefix tree whose edges are token spans: a
    lookup walks the tokens of a prompt once, comparing whole spans with numpy. ``put`` keeps a value at a prefix
    (returning the one it replaces in that slot), ``remove`` forgets one (a node left with nothing and at most one
    child is merged away), ``path`` gives the nodes with a value in a slot along a prompt. Not thread-safe by itself:
    its keepers (the checkpoint cache and the parked conversations) hold ``lock`` (reentrant, shared) around every
    call; readers on other threads read the keepers' views (``view``), which never wait on the lock."""

    def __init__(self):
        self.root = Node(None, _EMPTY)
        self.lock = threading.RLock()
        self._n = dict.fromkeys(SLOTS, 0)
        #: changes on every put and remove: a lookup made at one version still holds while the version is the same
        self.version = 0
        self._views: dict[str, list] = {}        # name -> [compute, the value published last]

    def __len__(self) -> int:
        return self._n["value"]

    def add_view(self, name: str, compute: Callable[[], Any]) -> None:
        """Register a keeper's view `name`: ``compute()`` (pure, run under the lock) gives what readers on other
        threads see of what it keeps (/status, `stratactl cache`); computed once now."""
        with self.lock:
            self._views[name] = [compute, compute()]

    def view(self, name: str) -> Any:
        """The view `name` for a reader on any thread, never held up by slow work of a keeper: computed now when the
        lock comes within VIEW_WAIT seconds (at once when this thread holds it), else the one published last,
        which is the tree just before the work in progress (a keeper holds the lock across a device-to-host copy
        or a file write, and publishes first). Readers must not change it (keepers hand out copies)."""
        v = self._views[name]
        if not self.lock.acquire(timeout=VIEW_WAIT):
            return v[1]
        try:
            v[1] = v[0]()
            return v[1]
        finally:
            self.lock.release()

    def publish(self) -> None:
        """Compute every view now: keepers call it before work that holds the lock long, so that
        readers meanwhile see the tree as it was just before."""
        with self.lock:
            for v in self._views.values():
                v[1] = v[0]()

    def count(self, slot: str = "value") -> int:
        return self._n[slot]

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

    def along(self, ids: np.ndarray) -> tuple[list[Node], Node | None, int]:
        """One walk along the int32 ids `ids` -> (the nodes whose prefix is a prefix of `ids`, root first; the
        child of the last one that `ids` enters and leaves part-way through its span (or ends inside), None when
        `ids` enters no child; how many tokens of `ids` that child's prefix shares, else 0)."""
        path = list(self._walk(ids))
        last, n = path[-1], int(ids.shape[0])
        if last.pos >= n:
            return path, None, 0
        child = last.children.get(int(ids[last.pos]))
        if child is None:
            return path, None, 0
        return path, child, last.pos + common_prefix(child.span, ids[last.pos:min(n, child.pos)])

    def path(self, tokens, slot: str = "value") -> list[Node]:
        """The nodes that keep a value in `slot` and whose prefix is a prefix of `tokens`, shallowest first."""
        return [n for n in self._walk(as_ids(tokens)) if getattr(n, slot) is not None]

    def find(self, tokens) -> Node | None:
        """The node that ends exactly at the prefix `tokens`, or None."""
        ids = as_ids(tokens)
        last = None
        for last in self._walk(ids):
            pass
        return last if last is not None and last.pos == int(ids.shape[0]) else None

    def put(self, tokens, value: Any, slot: str = "value") -> tuple[Node, Any]:
        """Keep `value` in `slot` at the prefix `tokens` (non-empty) -> (its node, the value it replaced or None)."""
        _check_slot(slot)
        ids = as_ids(tokens)
        n = int(ids.shape[0])
        if n == 0:
            raise ValueError("a checkpoint keeps at least one token")
        node = self.root
        while True:
            if node.pos == n:
                old = getattr(node, slot)
                setattr(node, slot, value)
                self._n[slot] += old is None
                self.version += 1
                return node, old
            child = node.children.get(int(ids[node.pos]))
            if child is None:                                   # a new branch from here
                leaf = Node(node, ids[node.pos:].copy(), value, slot)
                node.children[int(ids[node.pos])] = leaf
                self._n[slot] += 1
                self.version += 1
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

    def remove(self, node: Node, slot: str = "value") -> Any:
        """Forget the value kept in `slot` at `node` -> it; the node goes when nothing is kept at it or below it, and
        a node left with nothing and one child is merged into it."""
        _check_slot(slot)
        old = getattr(node, slot)
        setattr(node, slot, None)
        self._n[slot] -= old is not None
        self.version += 1
        while node is not self.root and node.empty() and len(node.children) <= 1:
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

    def pin(self, node: Node) -> None:
        """One more holder of the checkpoint kept at `node` (a parked conversation on its path)."""
        node.pins += 1

    def unpin(self, node: Node) -> None:
        """One holder fewer of `node`'s checkpoint. ValueError (one line) when it has none."""
        if node.pins <= 0:
            raise ValueError(f"internal: unpinning the node at {node.pos}, which has no pins")
        node.pins -= 1

    def pin_count(self) -> int:
        """The pins on the nodes in the tree, all together (each parked conversation's, CheckpointTree.pin)."""
        n, stack = 0, [self.root]
        while stack:
            x = stack.pop()
            n += x.pins
            stack.extend(x.children.values())
        return n

    def nodes(self, slot: str = "value") -> list[Node]:
        """Every node that keeps a value in `slot`, by position."""
        out, stack = [], [self.root]
        while stack:
            n = stack.pop()
            if getattr(n, slot) is not None:
                out.append(n)
            stack.extend(n.children.values())
        return sorted(out, key=lambda n: n.pos)

    def branches(self, slot: str = "value") -> int:
        """How many branches of history `slot` keeps: its nodes with none of that slot's below them."""
        def below(n: Node) -> tuple[int, bool]:         # (branches in n's subtree, whether it keeps any)
            leaves, keeps = 0, False
            for c in n.children.values():
                b, k = below(c)
                leaves, keeps = leaves + b, keeps or k
            if getattr(n, slot) is not None:
                return (leaves if keeps else 1), True
            return leaves, keeps
        return below(self.root)[0]
