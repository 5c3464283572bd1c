"""Checkpoint retention: which conversation checkpoints to evict, as one pure function."""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["Kept", "pinned_root", "choose_victims"]


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
    held = sorted((k for k in kept if k.held), key=lambda k: (k.last_use, k.saved, k.pos))
    total = sum(k.bytes for k in kept)
    kept = [k for k in kept if not k.held]
    if cap == 0:
        return [k.id for k in sorted(kept, key=lambda k: (k.saved, k.pos))] + \
            _over_bytes(held, total - sum(k.bytes for k in kept), budget_bytes)
    pin = pinned_root(kept, cap, root_min) if pin else None
    if cap == 1:
        order = sorted(kept, key=lambda k: (k.saved, k.pos))
    else:
        order = sorted((k for k in kept if k is not pin), key=lambda k: (k.last_use, k.saved, k.pos))
    victims: list[int] = []
    n = len(kept)
    for k in order:
        over_count = n > cap
        over_bytes = budget_bytes is not None and total > budget_bytes
        if not (over_count or over_bytes):
            break
        victims.append(k.id)
        n -= 1
        total -= k.bytes
    if pin is not None and budget_bytes is not None and total > budget_bytes:
        victims.append(pin.id)
        total -= pin.bytes
    return victims + _over_bytes(held, total, budget_bytes)


def _over_bytes(held: list[Kept], total: int, budget_bytes: int | None) -> list[int]:
    """The held checkpoints (least recently used first) that go while `total` bytes exceed the budget."""
    out = []
    for k in held:
        if budget_bytes is None or total <= budget_bytes:
            break
        out.append(k.id)
        total -= k.bytes
    return out
