"""SequenceState: one sequence's tokens, position, KV page table and running state; capture / restore / hash / nbytes."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from strata.kv_cache import PagedKV


class StateMismatch(ValueError):
    """A snapshot cannot be restored into this sequence (its KV arena no longer holds the snapshot's tokens)."""


def _host(a: Any) -> np.ndarray:
    """A numpy copy/view of a numpy or CuPy array."""
    return a.get() if hasattr(a, "get") and not isinstance(a, np.ndarray) else np.asarray(a)


def _copy_running(running: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {layer: {k: a.copy() for k, a in parts.items()} for layer, parts in running.items()}


def _running_nbytes(running: dict[int, dict[str, Any]]) -> int:
    return sum(int(a.nbytes) for parts in running.values() for a in parts.values())


@dataclass
class Snapshot:
    """The sequence at position `pos`: the token prefix, and a copy of the running state of recurrent layers.

    Attention K/V is not copied: it is the KV length `pos` over the arena's pages, valid while the arena still
    holds these tokens at [0, pos) (checked on restore).
    """

    pos: int
    tokens: tuple[int, ...]
    running: dict[int, dict[str, Any]] = field(default_factory=dict)

    def nbytes(self) -> int:
        """Bytes this snapshot holds itself: running-state copies + token ids (int32)."""
        return _running_nbytes(self.running) + 4 * len(self.tokens)


class SequenceState:
    """One sequence on the engine (DESIGN.md: tokens, position, page table, running state).

    tokens: ids read so far (len == pos); kv: the attention layers' page table (kv.length == pos between
    forward calls); running: recurrent layers' state, layer -> {"conv": ..., "ssm": ...} float32 arrays,
    updated in place by the model.
    """

    def __init__(self, kv: PagedKV, running: dict[int, dict[str, Any]] | None = None):
        self.kv = kv
        self.tokens: list[int] = []
        self.pos = 0
        self.running: dict[int, dict[str, Any]] = running if running is not None else {}
        self._running_init = _copy_running(self.running)  # the state at pos 0, for reset()

    def advance(self, tokens) -> None:
        """Record tokens read by a forward pass (called by the model after it committed the KV)."""
        self.tokens.extend(int(t) for t in tokens)
        self.pos = len(self.tokens)

    def truncate(self, p: int) -> None:
        """Cut the sequence back to p tokens (KV length p, pages kept).

        Raises ValueError when p is outside [0, pos], or when recurrent running state exists and p != pos
        (a running state only moves forward: restore a Snapshot instead). p == 0 always works: it resets.
        """
        if not 0 <= p <= self.pos:
            raise ValueError(f"truncate({p}) outside [0, {self.pos}]")
        if p == self.pos:
            return
        if self.running and p != 0:
            raise ValueError(f"cannot cut a recurrent running state back from {self.pos} to {p}; restore a snapshot")
        if p == 0:
            self.reset()
            return
        self.kv.truncate(p)
        del self.tokens[p:]
        self.pos = p

    def reset(self) -> None:
        """Back to position 0 (pages kept, running state zeroed to its initial value)."""
        self.kv.truncate(0)
        self.tokens = []
        self.pos = 0
        for layer, parts in self._running_init.items():
            for k, a in parts.items():
                self.running[layer][k][...] = a

    def capture(self) -> Snapshot:
        """Snapshot at the current position (copies the running state; K/V stays in the arena)."""
        return Snapshot(pos=self.pos, tokens=tuple(self.tokens), running=_copy_running(self.running))

    def restore(self, snap: Snapshot) -> None:
        """Return to `snap`: KV cut back to snap.pos (pages kept), tokens to snap's, running state copied in.

        Raises StateMismatch, changing nothing, when the arena does not hold snap's tokens at [0, snap.pos)
        (it has fewer positions, or diverged before snap.pos), or when the running-state layout differs.
        """
        if snap.pos > self.pos:
            raise StateMismatch(f"cannot restore position {snap.pos}: the KV arena holds only {self.pos} tokens")
        if tuple(self.tokens[:snap.pos]) != snap.tokens:
            first = next(i for i, (a, b) in enumerate(zip(self.tokens, snap.tokens)) if a != b)
            raise StateMismatch(f"cannot restore position {snap.pos}: the KV arena diverged from the snapshot "
                                f"at position {first}")
        if set(snap.running) != set(self.running) or any(
                set(snap.running[layer]) != set(self.running[layer]) for layer in snap.running):
            raise StateMismatch("snapshot running-state layers differ from this sequence's")
        for layer, parts in snap.running.items():
            for k, a in parts.items():
                dst = self.running[layer][k]
                if dst.shape != a.shape:
                    raise StateMismatch(f"running state {layer}/{k} has shape {a.shape}, expected {dst.shape}")
        for layer, parts in snap.running.items():
            for k, a in parts.items():
                self.running[layer][k][...] = a
        self.kv.truncate(snap.pos)
        del self.tokens[snap.pos:]
        self.pos = snap.pos

    def hashes(self) -> dict[str, str]:
        """sha256 hex digest per field: "tokens" (int32 ids), "kv" (K then V of every attention layer over
        [0, pos), in layer order, independent of which pages hold them), "running" (each recurrent layer's
        arrays in layer / name order)."""
        out = {}
        out["tokens"] = hashlib.sha256(np.asarray(self.tokens, dtype=np.int32).tobytes()).hexdigest()
        h = hashlib.sha256()
        pool = self.kv.pool
        for slot in range(len(pool.layers)):
            k, v = self.kv.read(slot, self.pos)
            h.update(np.ascontiguousarray(_host(k)).tobytes())
            h.update(np.ascontiguousarray(_host(v)).tobytes())
        out["kv"] = h.hexdigest()
        h = hashlib.sha256()
        for layer in sorted(self.running):
            for name in sorted(self.running[layer]):
                h.update(f"{layer}/{name}".encode())
                h.update(np.ascontiguousarray(_host(self.running[layer][name])).tobytes())
        out["running"] = h.hexdigest()
        return out

    def nbytes(self) -> int:
        """Bytes of this sequence's state: valid K/V + running state + token ids (int32)."""
        return self.kv.nbytes() + _running_nbytes(self.running) + 4 * len(self.tokens)

    def release(self) -> None:
        """Give the KV pages back to the pool (the state is unusable afterwards until reset)."""
        self.kv.release()
        self.tokens = []
        self.pos = 0
