"""Lookup: where a prompt can resume from the checkpoint tree, found in one walk along the prompt over both of the
tree's slots: the deepest checkpoint on its path and the parked conversation that skips most of it (every tier)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from strata.cache.parked import TIERS, Parked
from strata.cache.tree import CheckpointTree, Node
from strata.text.token_ids import as_ids, same_ids

__all__ = ["Found", "lookup"]


@dataclass(frozen=True, eq=False)
class Found:
    """What one walk along a prompt (``ids``) found in the tree at its ``version`` (it holds while the tree's version
    is the same: ``current``).

    path: the nodes whose prefix is a prefix of the prompt, root first. checkpoint: the deepest of them that keeps
    a checkpoint and is shorter than the prompt (one token at least is read, for the logits), or None. parked: the
    parked conversation that skips most of the prompt (Conversation.depth), or None; a tie goes to the nearest
    tier (device, RAM, disk), then to the most recently used, then to the last one parked. depth: the tokens it
    skips (0 with None)."""

    tree: CheckpointTree
    version: int
    ids: np.ndarray
    path: tuple[Node, ...]
    checkpoint: Node | None
    parked: Parked | None
    depth: int

    def current(self, ids: np.ndarray) -> bool:
        """Whether this lookup is still the tree's answer for the prompt `ids` (nothing kept or forgotten since)."""
        return self.tree.version == self.version and (self.ids is ids or same_ids(self.ids, ids))

    def deepest_checkpoint(self, limit: int) -> int:
        """The position of the deepest checkpoint on the prompt's path at or before `limit` (0 when none)."""
        return max((nd.pos for nd in self.path if nd.value is not None and nd.pos <= limit), default=0)


def lookup(tree: CheckpointTree, prompt) -> Found:
    """Walk `tree` once along `prompt` (token ids, non-empty) -> what it can resume from (Found). Pure: reads the
    tree under its lock and changes nothing (a parked conversation whose file the disk tier removed is passed over,
    not forgotten).

    Parked conversations whose node is off the prompt's path are reached from the path: those below a path node's
    other children share exactly that node's tokens with the prompt, those below the child the prompt leaves
    part-way share the tokens up to where it leaves; so they are visited from the deepest share up, and the
    visit stops where no conversation could skip as much as the best found (a conversation skips at most the
    tokens it shares)."""
    ids = as_ids(prompt)
    n = int(ids.shape[0])
    with tree.lock:
        path, part, shared = tree.along(ids)
        checkpoint = None
        for nd in path:
            if nd.value is not None and nd.pos < n:
                checkpoint = nd
        best: list = [None, (0,)]

        def consider(p: Parked, common: int) -> None:
            if p.tier == "disk" and p.file.gone:
                return
            d = p.conv.depth_at(common, n)
            key = (d, -TIERS.index(p.tier), p.conv.last_use, p.saved)
            if d > 0 and key > best[1]:
                best[0], best[1] = p, key

        def below(node: Node, common: int) -> None:
            stack = [node]
            while stack:
                x = stack.pop()
                if x.parked is not None:
                    consider(x.parked, common)
                stack.extend(x.children.values())

        if part is not None:
            below(part, shared)
        nxt = part
        for nd in reversed(path[1:]):            # the root's other branches share no token: nothing skips any
            if min(nd.pos, n - 1) < max(best[1][0], 1):
                break
            if nd.parked is not None:
                consider(nd.parked, nd.pos)
            for child in nd.children.values():
                if child is not nxt:
                    below(child, nd.pos)
            nxt = nd
        return Found(tree, tree.version, ids, tuple(path), checkpoint, best[0], best[1][0])
