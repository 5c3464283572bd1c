"""SequenceState: one sequence of a stage as its runner sees it (position, page tables, running state), its other
operations forwarded to the Memory that owns it."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from strata.memory.kv import PagedKV
from strata.memory.part import StatePart

if TYPE_CHECKING:
    from strata.memory.memory import Memory


class Steps:
    """Where a forward of up to ``n`` tokens read at position ``base`` keeps the running state after each token:
    ``layers`` maps a recurrent layer to {"conv": (n, ...), "ssm": (n, ...)} (row t: after token base + t)."""

    __slots__ = ("base", "n", "layers")

    def __init__(self, base: int, n: int, layers: dict[int, dict[str, Any]]):
        self.base, self.n, self.layers = base, n, layers


class SequenceState:
    """One sequence as a stage's runner sees it: ``pos`` (tokens read), ``kv`` (the page table of the stage's
    attention layers, or None), ``running`` (recurrent layer -> {"conv", "ssm"} float32 arrays, updated in place),
    ``draft`` (the MTP drafter's page table on the stage that carries it, or None), ``steps`` (Steps while a verify's
    per-position running states are kept, else None). The runner reserves / commits K/V around a forward pass and
    calls ``advance``; everything else goes through the Memory that owns it
    (``memory``, under id ``sid``; the methods below are that Memory's operations on this sequence)."""

    __slots__ = ("pos", "kv", "running", "draft", "steps", "memory", "sid", "__weakref__")

    def __init__(self, memory: "Memory", sid: int):
        self.pos = 0
        self.kv: PagedKV | None = None
        self.running: dict[int, dict[str, Any]] = {}
        self.draft: PagedKV | None = None
        self.steps: Steps | None = None
        self.memory = memory
        self.sid = sid

    def advance(self, tokens) -> None:
        """Record that a forward pass read `tokens` (after it committed their K/V)."""
        self.pos += len(tokens)

    def capture(self) -> StatePart:
        return self.memory.capture(self.sid)

    def restore(self, part: StatePart) -> None:
        self.memory.restore(self.sid, part)

    def truncate(self, p: int) -> None:
        self.memory.truncate(self.sid, p)

    def reset(self) -> None:
        self.memory.reset(self.sid)

    def hashes(self) -> dict[str, str]:
        return self.memory.hashes(self.sid)

    def nbytes(self) -> int:
        return self.memory.nbytes(self.sid)

    def release(self) -> None:
        """Give the sequence's pages back; the memory forgets it."""
        self.memory.drop_seq(self.sid)

