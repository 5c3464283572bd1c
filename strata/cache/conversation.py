"""Conversation (a whole conversation held apart from the engine: tokens, one host part per stage, its checkpoints)
and how deep it can resume a prompt; ParkStore, the parked conversations in host RAM under a byte budget, LRU."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

from strata.memory import StatePart


@dataclass
class SavedCheckpoint:
    """One checkpoint of a conversation held apart: position, kind and one part per stage whose K/V is a prefix
    of the conversation's own (StatePart.is_prefix): only its running state takes bytes."""

    pos: int
    kind: str
    parts: list[StatePart]


@dataclass
class Conversation:
    """A conversation off the engine (parked in RAM, or read from a session file): its token ids, one
    materialized part per stage (K/V of its used pages and running state, host copies), its checkpoints and
    whether its end may be continued live (False after a "strata_checkpoint": false request, seed #861)."""

    tokens: tuple[int, ...]
    parts: list[StatePart]
    checkpoints: list[SavedCheckpoint] = field(default_factory=list)
    live_ok: bool = True
    last_use: float = field(default_factory=time.time)

    @property
    def pos(self) -> int:
        return len(self.tokens)

    def nbytes(self) -> int:
        return (sum(p.nbytes() for p in self.parts) + 4 * len(self.tokens) +
                sum(p.nbytes() for c in self.checkpoints for p in c.parts))

    def depth(self, prompt: Sequence[int]) -> int:
        """How many of the prompt's tokens this conversation can skip: its whole length when the prompt extends
        it (and its end may be continued), else its deepest checkpoint that is a prefix of the prompt; always
        shorter than the prompt (one token at least is read), 0 when nothing matches."""
        n = len(prompt)
        common = _common_prefix(self.tokens, prompt)
        if self.live_ok and common == self.pos < n:
            return self.pos
        return max((c.pos for c in self.checkpoints if c.pos <= common and c.pos < n), default=0)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class ParkStore:
    """Parked conversations in host RAM (``--conversation-cache-mib``): ``park`` adds one and evicts the least
    recently used to stay under the budget (one that alone is over it is not kept); ``best(prompt)`` is the one
    that skips most of a prompt (deepest match, ties to the most recent), never one that shares no prefix with it;
    ``take`` removes it (it becomes the live conversation). Thread-safe (status reads from the event loop)."""

    def __init__(self, budget_bytes: int):
        if budget_bytes < 0:
            raise ValueError(f"--conversation-cache-mib must be >= 0, got {budget_bytes}")
        self.budget = int(budget_bytes)
        self._items: list[Conversation] = []
        self._lock = threading.Lock()
        self.stats = {"parked": 0, "restored": 0, "evicted": 0, "refused": 0}

    def __len__(self) -> int:
        return len(self._items)

    def nbytes(self) -> int:
        with self._lock:
            return sum(c.nbytes() for c in self._items)

    def park(self, conv: Conversation) -> list[Conversation]:
        """Keep `conv` (replacing a parked one with the same tokens); returns the conversations evicted."""
        size = conv.nbytes()
        with self._lock:
            if size > self.budget:
                self.stats["refused"] += 1
                return [conv]
            self._items = [c for c in self._items if c.tokens != conv.tokens]
            conv.last_use = time.time()
            self._items.append(conv)
            self.stats["parked"] += 1
            gone = []
            while sum(c.nbytes() for c in self._items) > self.budget:
                victim = min(self._items, key=lambda c: c.last_use)
                self._items.remove(victim)
                gone.append(victim)
            self.stats["evicted"] += len(gone)
            return gone

    def best(self, prompt: Sequence[int]) -> tuple[Conversation | None, int]:
        """(the parked conversation that skips most of `prompt`, how many tokens), or (None, 0)."""
        with self._lock:
            best, depth = None, 0
            for c in self._items:
                d = c.depth(prompt)
                if d > depth or (d == depth and d > 0 and best is not None and c.last_use > best.last_use):
                    best, depth = c, d
            return best, depth

    def take(self, conv: Conversation) -> None:
        with self._lock:
            self._items.remove(conv)
            self.stats["restored"] += 1

    def discard(self, tokens) -> None:
        """Drop parked conversations holding exactly these tokens (one that became live by another way)."""
        with self._lock:
            self._items = [c for c in self._items if c.tokens != tuple(tokens)]

    def clear(self) -> None:
        with self._lock:
            self._items.clear()

    def entries(self) -> list[dict]:
        """For `stratactl cache`: tokens, bytes, tier, checkpoints, last use (Unix seconds), most recent first."""
        with self._lock:
            return [{"tokens": c.pos, "bytes": c.nbytes(), "tier": "ram", "checkpoints": len(c.checkpoints),
                     "last_use_time": c.last_use} for c in sorted(self._items, key=lambda c: -c.last_use)]
