"""Retention: what leaves a tier when it is over its budgets (``evict``, one pure function over the checkpoints and
the parked conversations of a tier alike) and the checkpoint policy on top of it (``choose_victims``)."""
from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass

__all__ = ["Item", "evict", "Kept", "pinned_root", "choose_victims"]


@dataclass(frozen=True)
class Item:
    """One thing kept in a tier, as the eviction pass sees it (a checkpoint or a parked conversation alike).

    key: what names it (unique among the items of one pass). order: when it was last used (smaller: longer ago;
    ties broken by what follows in the tuple), the order it goes in. costs: budget name -> what it takes of that
    budget (1 for a count, bytes for a byte budget), each >= 0. by: the budgets whose excess may evict it (None: every
    budget it has a cost in). stage: it goes only after every item of a lower stage (0: plain; the checkpoint policy
    uses 1 for the pinned root, 2 for the checkpoints a parked conversation holds)."""

    key: Hashable
    order: tuple
    costs: Mapping[str, int]
    by: frozenset | None = None
    stage: int = 0


def evict(items: Sequence[Item], budgets: Mapping[str, int | None]) -> list[tuple[Hashable, frozenset]]:
    """The one eviction pass over the items of a tier, whatever kind they are: in order of (stage, order), an item
    goes while a budget that may evict it is over (its total cost above the budget; a budget None, or one not
    named, has no limit), and its costs then leave every budget it counts in. -> (key, the budgets that were over)
    for each item that goes, in eviction order.

    Pure: reads its arguments only. ValueError (one line) for a negative budget or cost, or duplicate keys."""
    for name, b in budgets.items():
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 0):
            raise ValueError(f"budget {name} must be an integer >= 0 or None, got {b!r}")
    total: dict[str, int] = {}
    seen: set = set()
    for it in items:
        if it.key in seen:
            raise ValueError(f"two items named {it.key!r}: keys must be unique")
        seen.add(it.key)
        for name, c in it.costs.items():
            if c < 0:
                raise ValueError(f"item {it.key!r} has a negative cost {c} for {name}")
            total[name] = total.get(name, 0) + c
    out = []
    for it in sorted(items, key=lambda i: (i.stage, i.order)):
        names = it.costs.keys() if it.by is None else it.by
        over = frozenset(n for n in names if budgets.get(n) is not None and total.get(n, 0) > budgets[n])
        if not over:
            continue
        out.append((it.key, over))
        for name, c in it.costs.items():
            total[name] -= c
    return out


@dataclass(frozen=True)
class Kept:
    """What retention knows of one kept checkpoint.

    pos: prompt position (tokens) the checkpoint resumes at, > 0.
    kind: the cut point kind it was saved at ("root", "message", "turn", "pin", "periodic", "tail");
    informational only, retention decides by position, use and size.
    last_use: logical time of the last save or mount (larger is more recent; re-dated on every mount).
    bytes: memory the checkpoint holds of its own (running state copy; attention KV pages are the pool's, held
    by reference count, and not counted: a short pool evicts apart, CheckpointCache.make_room), >= 0.
    saved: logical time of the save (insertion order), used by the first-in-first-out mode (cap 1).
    key: what names it among the kept ones (unique; None: its pos, which must then be unique). Several branches
    of a prefix tree can keep a checkpoint at one position: their keys tell them apart.
    held: referenced by a parked conversation (CheckpointTree.pin): not counted against the cap and never its
    victim; the byte budget moves it down a tier after every unheld one (the caller never drops it for that).
    """

    pos: int
    kind: str
    last_use: int
    bytes: int
    saved: int = 0
    key: int | None = None
    held: bool = False

    @property
    def id(self) -> int:
        return self.pos if self.key is None else self.key


def _check(kept: Sequence[Kept], cap: int, root_min: int, budget_bytes: int | None) -> None:
    if not isinstance(cap, int) or cap < 0:
        raise ValueError(f"cap (--prompt-cache) must be an integer >= 0, got {cap!r}")
    if not isinstance(root_min, int) or root_min < 0:
        raise ValueError(f"root_min (--prompt-cache-root) must be an integer >= 0, got {root_min!r}")
    if budget_bytes is not None and (not isinstance(budget_bytes, int) or budget_bytes < 0):
        raise ValueError(f"budget_bytes (--prompt-cache-mib) must be an integer >= 0 or None, got {budget_bytes!r}")
    seen: set[int] = set()
    for k in kept:
        if k.pos <= 0:
            raise ValueError(f"a checkpoint position must be > 0, got {k.pos}")
        if k.bytes < 0:
            raise ValueError(f"checkpoint at {k.pos} has a negative size {k.bytes}")
        if k.id in seen:
            raise ValueError(f"two kept checkpoints named {k.id}: positions (or keys) must be unique")
        seen.add(k.id)


def pinned_root(kept: Iterable[Kept], cap: int, root_min: int) -> Kept | None:
    """The checkpoint retention pins, or None.

    The kept checkpoints form a prefix tree (branches of one system prompt: sub-agents, regenerations, edited
    turns); the shallowest one is the root the branches share (a system prompt's end), the most recently used
    of them when several are equally shallow. It is pinned when cap >= 2 (cap 1 is the old first-in-first-out
    behaviour, with no pin) and its length is at least root_min tokens.
    """
    kept = list(kept)
    if cap < 2 or not kept:
        return None
    root = min(kept, key=lambda k: (k.pos, -k.last_use))
    return root if root.pos >= root_min else None


def choose_victims(kept: Sequence[Kept], *, cap: int, root_min: int = 0,
                   budget_bytes: int | None = None, pin: bool = True) -> list[int]:
    """Which kept checkpoints to evict -> their ids (Kept.id: the key, else the position), in eviction order (first
    = evicted first).

    The policy ("the conversation cache keeps its shared prefix; the rest rotates LRU"):

    * held checkpoints (Kept.held: a parked conversation references them) are outside the count: the cap
      bounds the unheld ones, and no rule below evicts a held one for the count.
    * cap 0 (``--prompt-cache 0``): keep none; every unheld checkpoint is a victim.
    * cap 1: plain first-in-first-out by save order, no pin — the old behaviour exactly.
    * cap >= 2: the root (see :func:`pinned_root`: the shallowest checkpoint of the prefix chain, when it
      is at least ``root_min`` tokens long) is pinned and never a victim of the count limit; the others are
      evicted least-recently-used first (``last_use``, ties broken by save order then position) until at
      most ``cap`` remain, whichever branch of the tree they are on.
    * ``budget_bytes`` (``--prompt-cache-mib``): after the count limit, unpinned checkpoints keep going in
      the same order while the kept bytes exceed the budget; if the pinned root alone still exceeds it, the
      root goes too, then the held ones, least recently used first (the budget is a hard cap on memory: the
      caller moves a held victim down a tier, never drops it). None means no byte limit.
    * pin=False: no root is pinned (the parked conversations of a tier: plain LRU under its count and bytes).

    Pure: reads its arguments only, changes nothing. Raises ValueError (one line) for a negative cap,
    root_min or budget, a position <= 0, a negative size or duplicate ids.
    """
    kept = list(kept)
    _check(kept, cap, root_min, budget_bytes)
    root = pinned_root([k for k in kept if not k.held], cap, root_min) if pin and cap >= 2 else None
    return [key for key, _ in evict(checkpoint_items(kept, cap, root), {"count": cap, "bytes": budget_bytes})]


def checkpoint_items(kept: Sequence[Kept], cap: int, root: Kept | None, count: str | None = "count",
                     nbytes: str | None = "bytes", clock=None) -> list[Item]:
    """The kept checkpoints as items of the eviction pass (``evict``), by the checkpoint policy (see
    ``choose_victims``): each unheld one costs 1 of the `count` budget and its bytes of the `nbytes` one (a name
    None: no such cost); `root` (the pinned one) goes by the bytes alone, after the others; a held one costs its
    bytes alone and goes last. Order: save order with cap 0 or 1, else last use (`clock(k)`: a tuple of numbers,
    its time first, default (Kept.last_use,)), ties by save order then position."""
    out = []
    for k in kept:
        costs = {}
        if count is not None and not k.held:
            costs[count] = 1
        if nbytes is not None:
            costs[nbytes] = k.bytes
        when = clock(k) if clock is not None else (k.last_use,)
        order = (k.saved, k.pos) if cap <= 1 and not k.held else (*when, k.saved, k.pos)
        stage = 2 if k.held else 1 if k is root else 0
        by = frozenset([nbytes] if nbytes is not None else []) if stage else None
        out.append(Item(k.id, order, costs, by, stage))
    return out
