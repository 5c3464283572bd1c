"""HeldCheckpoints: where a checkpoint of the tree keeps its K/V once it leaves the device: its running state in host
RAM and its K/V read from the host copy of a conversation parked in RAM that extends it (a prefix of that copy), or
in full when no such conversation is left."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import structlog

from strata.cache.checkpoints import CheckpointCache
from strata.cache.conversation import Conversation
from strata.cache.parked import ParkedConversations
from strata.cache.tree import Node
from strata.memory import PartMismatch
from strata.memory.hostram import available_ram
from strata.stages.sequence import Checkpoint
from strata.text.token_ids import is_prefix

log = structlog.get_logger("strata.engine")

__all__ = ["HeldCheckpoints", "PrefixCheckpoint", "is_prefix_form"]


@dataclass(eq=False)
class PrefixCheckpoint:
    """A checkpoint in host RAM that keeps its running state only (one part per stage, Memory.detach: its K/V a
    prefix) and no token ids: its node's path in the tree gives them, a donor's host copy its K/V (see
    HeldCheckpoints). Holds no pages."""

    pos: int
    node: Node
    parts: list

    @property
    def tokens(self) -> np.ndarray:
        return self.node.tokens()

    def nbytes(self) -> int:
        return sum(p.nbytes() for p in self.parts)

    def release(self) -> None:
        """Nothing held."""


def is_prefix_form(snap) -> bool:
    """Whether a checkpoint's snapshot keeps its running state only, its K/V a prefix of a donor's."""
    return isinstance(snap, PrefixCheckpoint)


class HeldCheckpoints:
    """The host side of the tree's checkpoints. A checkpoint moved off the device (``to_host``) keeps its running
    state as host copies and, where every stage can take K/V rows from a host copy (Memory.prefix_rows), its K/V as
    a prefix of a *donor*: a conversation parked in host RAM whose tokens extend the checkpoint's (its host copy
    holds the same K/V rows: the checkpoint costs its running state alone, as a parked conversation's own
    checkpoint copies did). ``join`` gives such a checkpoint its K/V back from a donor to be restored or written.
    Invariant: a checkpoint in prefix form always has a donor: before a conversation's host copy leaves RAM
    (moved to disk, dropped, taken back), ``leaving`` gives the checkpoints that read from it alone their K/V
    rows of their own. ``settle`` moves down the checkpoints parked conversations hold that no live sequence and
    no conversation parked on the device extends (their pages given back), and makes a checkpoint holding its
    K/V in host RAM a prefix again once a donor is parked. Runs under the tree's lock."""

    def __init__(self, checkpoints: CheckpointCache, parking: ParkedConversations, stages: list):
        self.checkpoints, self.parking, self.stages = checkpoints, parking, stages
        self.tree = checkpoints.tree

    @property
    def prefix_rows(self) -> bool:
        """Whether checkpoints can keep their K/V as a donor's prefix (every stage local, parking in host RAM on)."""
        return self.parking.ram is not None and \
            all(st.memory.prefix_rows and st.memory.host_parts for st in self.stages)

    def donor(self, tokens, skip: Conversation | None = None) -> Conversation | None:
        """A conversation parked in host RAM (not `skip`) whose tokens extend `tokens`, the most recently used."""
        node = self.tree.find(tokens)
        if node is None:
            return None
        best, stack = None, [node]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            p = n.parked
            if p is not None and p.tier == "ram" and p.conv is not skip and p.conv.parts and \
                    (best is None or p.conv.last_use > best.last_use):
                best = p.conv
        return best

    def _resident_below(self, node) -> bool:
        """Whether a conversation parked on the device extends `node`'s tokens (its pages cover the node's)."""
        stack = [node]
        while stack:
            n = stack.pop()
            if n.parked is not None and n.parked.tier == "device":
                return True
            stack.extend(n.children.values())
        return False

    def join(self, snap: PrefixCheckpoint, copy: bool = False,
             donor: Conversation | None = None) -> Checkpoint | None:
        """`snap` (prefix form) with its K/V rows from `donor` (default: ``donor(snap.tokens)``): views of the
        donor's arrays, or arrays of its own (copy) -> a checkpoint restore takes; None without a donor that fits."""
        donor = donor if donor is not None else self.donor(snap.tokens)
        if donor is None:
            return None
        try:
            parts = [st.memory.join_prefix(p, d, copy) for st, p, d in zip(self.stages, snap.parts, donor.parts)]
        except PartMismatch as e:
            log.warning("a parked conversation's K/V does not cover a checkpoint it extends", error=str(e))
            return None
        return Checkpoint(pos=snap.pos, tokens=snap.tokens, parts=parts)

    def to_host(self, snap: Checkpoint, node: Node | None = None) -> Checkpoint | PrefixCheckpoint | None:
        """`snap` (held on the devices; kept at `node` of the tree) as host copies: a PrefixCheckpoint when a donor
        extends it, else K/V and running state in full -> it, or None when host RAM is short (it stays where it is,
        or is dropped). The caller gives the device pages back."""
        node = node if node is not None else self.tree.find(snap.tokens)
        prefix = node is not None and self.prefix_rows and self.donor(snap.tokens) is not None
        need = sum(p.nbytes() for p in snap.parts)
        if not prefix:
            need += sum(k.length * k.hold.pool.bytes_per_token for p in snap.parts
                        for k in getattr(p, "kv", {}).values() if k.is_held)
        avail = available_ram()
        if avail is None or need > avail // 2:
            return None
        self.tree.publish()                     # readers see the tree as it is before the copy
        mem = [st.memory for st in self.stages]
        if prefix:
            return PrefixCheckpoint(snap.pos, node, [m.detach(p, True) for m, p in zip(mem, snap.parts)])
        return Checkpoint(pos=snap.pos, tokens=snap.tokens, parts=[m.materialize(p) for m, p in zip(mem, snap.parts)])

    def leaving(self, conv: Conversation) -> None:
        """`conv`'s host copy is about to leave host RAM: every checkpoint in prefix form that has no other donor
        takes its K/V rows from it (copies of its own; dropped when they do not fit)."""
        if not conv.parts:
            return
        for snap, tokens, _ in self.checkpoints.held_snapshots(conv.tokens):
            if not is_prefix_form(snap) or self.donor(tokens, skip=conv) is not None:
                continue
            whole = self.join(snap, copy=True, donor=conv)
            if whole is None:
                self.checkpoints.discard(snap)
            else:
                self.checkpoints.rehome(snap, whole, "ram")

    def settle(self, live=()) -> None:
        """The checkpoints parked conversations hold that no live sequence (`live`: their token ids) and no
        conversation parked on the device extends move to host RAM (``to_host``: a prefix of a donor when there is
        one; their pages given back); a checkpoint holding its K/V in host RAM drops it for a donor's prefix."""
        if self.parking.ram is None:
            return
        live = [ids for ids in live if len(ids)]
        with self.tree.lock:
            for snap, tokens, node in self.checkpoints.device_held():
                if any(is_prefix(tokens, ids) for ids in live) or self._resident_below(node) or \
                        self.parking.host_parts_refusal() is not None:
                    continue
                try:
                    copy = self.to_host(snap, node)
                except Exception as e:  # noqa: BLE001 -- a copy that fails leaves it on the device
                    log.warning("a held checkpoint could not be moved to host RAM: it stays", error=str(e))
                    continue
                if copy is not None:
                    self.checkpoints.rehome(snap, copy, "ram", own_ids=not is_prefix_form(copy))
            if not self.prefix_rows:
                return
            for snap, tokens, node in self.checkpoints.held_snapshots():
                if not isinstance(snap, Checkpoint) or any(getattr(p, "is_held", False) for p in snap.parts) or \
                        self.donor(tokens) is None:
                    continue
                mem = [st.memory for st in self.stages]
                self.checkpoints.rehome(snap, PrefixCheckpoint(snap.pos, node, [m.detach(p, True) for m, p in
                                                                                  zip(mem, snap.parts)]),
                                        "ram", own_ids=False)
