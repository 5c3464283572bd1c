"""Carve, StatePart (one stage's part of a conversation's state at a position) and PartMismatch."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


class PartMismatch(ValueError):
    """A state part cannot be restored into this stage (carve, geometry, dtype, position or pages differ); the
    one-line message names the mismatch. Raised before anything is written."""


@dataclass(frozen=True)
class Carve:
    """The layers a stage runs: [lo, hi), half-open."""

    lo: int
    hi: int

    def __post_init__(self):
        if not (isinstance(self.lo, int) and isinstance(self.hi, int)) or not 0 <= self.lo < self.hi:
            raise ValueError(f"a carve needs 0 <= layer_lo < layer_hi, got {self.lo}..{self.hi}")

    def __contains__(self, layer: int) -> bool:
        return self.lo <= layer < self.hi

    def __iter__(self):
        return iter(range(self.lo, self.hi))

    def __len__(self) -> int:
        return self.hi - self.lo

    def __str__(self) -> str:
        return f"{self.lo}..{self.hi}"


@dataclass
class KVPages:
    """K/V of positions [0, length) of one page pool, in one of three forms.

    *held* (``hold``: a memory.kv.Hold: the pool's pages, one reference each, kept whatever the sequence that was
    captured does next: a write into a shared page copies it for whichever side reads past the write; ``release``
    gives them back), *host copies* (``arrays``: PagePool.export_rows, "L{layer}.{k|v|k_scale|v_scale}" -> array
    whose page and row axes are merged into one axis of ``length`` positions: the used rows only, never a whole
    last page): what parking in RAM and session files hold, or neither, a *prefix*: the first ``length`` positions
    of the K/V of the conversation the part
    travels with (a parked or saved conversation's checkpoints, whose K/V is a prefix of the conversation's own;
    Memory.attach_prefix makes it held again).
    """

    length: int
    arrays: dict[str, np.ndarray] | None = None
    hold: Any = None

    @property
    def is_held(self) -> bool:
        return self.hold is not None

    @property
    def is_prefix(self) -> bool:
        return self.arrays is None and self.hold is None

    def release(self) -> None:
        """Give the held pages back (idempotent; host copies and prefixes hold no pages)."""
        if self.hold is not None:
            self.hold.release()

    def nbytes(self) -> int:
        """Bytes this holds itself (held pages are the pool's: none)."""
        return 0 if self.arrays is None else sum(int(a.nbytes) for a in self.arrays.values())


@dataclass
class StatePart:
    """One stage's part of a conversation's state at position ``pos``.

    carve: the stage's layers. geometry: Memory.geometry() of the stage that captured it (shapes, dtypes, page
    size: everything a restore must match). running: recurrent layer -> {"conv", "ssm"} arrays (copies: on the
    stage's device when captured, host numpy when read from bytes). kv: pool name ("kv"; "draft" for the MTP
    drafter's K/V on the stage that carries it) -> KVPages.
    """

    carve: Carve
    geometry: dict[str, Any]
    pos: int
    running: dict[int, dict[str, Any]] = field(default_factory=dict)
    kv: dict[str, KVPages] = field(default_factory=dict)

    @property
    def is_held(self) -> bool:
        """True when some K/V is pages held in the stage's pool (see KVPages)."""
        return any(k.is_held for k in self.kv.values())

    def release(self) -> None:
        """Give back the pages the part holds (idempotent)."""
        for k in self.kv.values():
            k.release()

    @property
    def is_prefix(self) -> bool:
        """True when the K/V is the prefix of the conversation the part travels with (see KVPages)."""
        return any(k.is_prefix for k in self.kv.values())

    def nbytes(self) -> int:
        """Bytes this part holds itself: running-state copies + K/V it holds (not what it references)."""
        return sum(int(a.nbytes) for parts in self.running.values() for a in parts.values()) + \
            sum(k.nbytes() for k in self.kv.values())
