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


class Marks:
    """Where a forward read at position ``base`` keeps the running state at chosen positions (Memory.mark): ``at``
    maps each position p (base < p) to {recurrent layer: {"conv", "ssm"}} arrays the forward fills with the state
    after its token p - 1 (empty dicts for a memory with no running state)."""

    __slots__ = ("base", "at", "read")

    def __init__(self, base: int, at: dict[int, dict[int, dict[str, Any]]]):
        self.base, self.at = base, at
        self.read: set[int] = set()      # the positions a runner took up (marked_rows): their arrays are filled


class SequenceState:
    """One sequence as a stage's runner sees it: ``pos`` (tokens read), ``kv`` (the page table of the stage's
    attention layers, or None), ``running`` (recurrent layer -> {"conv", "ssm"} float32 arrays, updated in place),
    ``draft`` (the MTP drafter's page table on the stage that carries it, or None), ``steps`` (Steps while a verify's
    per-position running states are kept, else None), ``marks`` (Marks while a read keeps the running state at some
    positions for checkpoints, else None). The runner reserves / commits K/V around a forward pass and
    calls ``advance``; everything else goes through the Memory that owns it
    (``memory``, under id ``sid``; the methods below are that Memory's operations on this sequence)."""

    __slots__ = ("pos", "kv", "running", "draft", "steps", "marks", "memory", "sid", "__weakref__")

    def __init__(self, memory: "Memory", sid: int):
        self.pos = 0
        self.kv: PagedKV | None = None
        self.running: dict[int, dict[str, Any]] = {}
        self.draft: PagedKV | None = None
        self.steps: Steps | None = None
        self.marks: Marks | None = None
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



def marked_rows(state: SequenceState, n: int) -> list[tuple[int, dict]]:
    """The marks (Memory.mark) a forward of n tokens at state.pos reads past: [(row r, {recurrent layer: {"conv",
    "ssm"}})] in row order, 0 < r < n, the state after the forward's row r - 1 to be copied into those arrays. What
    a runner that keeps them calls (a runner that does not leaves them unread: capture_at then refuses them)."""
    m = state.marks
    if m is None:
        return []
    out = [(p - state.pos, m.at[p]) for p in sorted(m.at) if 0 < p - state.pos < n]
    m.read.update(r + state.pos for r, _ in out)
    return out
