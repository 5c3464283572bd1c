"""TurnClock: one request's time from its arrival to its first token leaving, split into named phases; the one owner
of those timings (serve and the engine charge phases to it; the response's strata block, /metrics and the request's
log line read its report)."""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager

from strata.engine import gc_pauses

__all__ = ["MODEL_PHASES", "PHASES", "TurnClock", "active", "phase", "charge", "current"]

#: the phases, in the order a request meets them: the body read and parsed (parse), the chat template rendered
#: (render) and its text tokenized (tokenize), the wait for the engine thread (queue), the conversation store's plan
#: and its apply step: restore / cut back / settle (plan), the model's forward calls (model), the engine steps' reads
#: of the other request slots while this request read its prompt beside them (slots, with --parallel N), checkpoints
#: saved (checkpoint), the first token sampled (sample), the first token's event carried to the event loop and
#: written to the socket (write). What no phase covers (validation, JSON building, the hops between threads) is
#: `other`.
PHASES = ("parse", "render", "tokenize", "queue", "plan", "model", "slots", "checkpoint", "sample", "write")
#: the phases that are the model's time (this request's forward calls, or the other slots' in the same steps)
MODEL_PHASES = ("model", "slots")

_local = threading.local()


class TurnClock:
    """The phases of one request up to its first token. `arrival`: time.perf_counter() when the request arrived (the
    middleware's first look at it). Phases are charged with ``add`` or, on the thread the clock is ``active`` on, the
    module's ``phase`` / ``charge``; a phase nested in another is charged to the inner one only (the outer one gets
    its own time minus its children's), so the phases never count a second twice.

    ``engine_done()`` (the engine delivered the first token's event) stops the engine's charges: its next forward
    calls are the second token's. ``first_token()`` (the first token written to the socket) ends the clock; charges
    after it are ignored. ``report()`` -> the JSON-ready summary, or None before the first token."""

    def __init__(self, arrival: float | None = None):
        self.arrival = time.perf_counter() if arrival is None else float(arrival)
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.delivered_at: float | None = None
        self.first_token_at: float | None = None
        self._gc0 = gc_pauses.seconds()
        self._gc = 0.0
        self._lock = threading.Lock()

    def add(self, name: str, seconds: float) -> None:
        """Charge `seconds` to phase `name` (one of PHASES; KeyError otherwise). Ignored after ``first_token``, and
        for every phase but write after ``engine_done``."""
        if name not in self.seconds:
            raise KeyError(f"unknown phase {name!r} (phases: {', '.join(PHASES)})")
        with self._lock:
            if self.first_token_at is not None or (self.delivered_at is not None and name != "write"):
                return
            self.seconds[name] += float(seconds)

    def set(self, name: str, seconds: float) -> None:
        """Phase `name` took `seconds` in all (a wait measured again on each try: the queue of a request that waited
        for its slot); ignored as ``add`` is."""
        with self._lock:
            if name not in self.seconds:
                raise KeyError(f"unknown phase {name!r} (phases: {', '.join(PHASES)})")
            if self.first_token_at is None and self.delivered_at is None:
                self.seconds[name] = float(seconds)

    def engine_done(self, t: float | None = None) -> None:
        """The first token's event left the engine (the first call counts)."""
        with self._lock:
            if self.delivered_at is None:
                self.delivered_at = time.perf_counter() if t is None else t

    def first_token(self, t: float | None = None) -> None:
        """The first token left the daemon (written to the socket; the first call counts): the clock stops."""
        t = time.perf_counter() if t is None else t
        with self._lock:
            if self.first_token_at is not None:
                return
            if self.delivered_at is not None:
                self.seconds["write"] += max(0.0, t - self.delivered_at)
            else:
                self.delivered_at = t
            self.first_token_at = t
            self._gc = gc_pauses.seconds() - self._gc0

    @property
    def done(self) -> bool:
        return self.first_token_at is not None

    def report(self) -> dict | None:
        """{"ms": arrival to first token, "outside_model_ms": that minus the model phases (model, slots),
        "phases_ms": {phase: ms},
        "other_ms": what no phase covers, "gc_ms": the garbage collector's pauses meanwhile (inside whichever
        phases they fell in; counted where strata.engine.gc_pauses is installed)}, milliseconds rounded to 3
        decimals; None before the first token."""
        with self._lock:
            if self.first_token_at is None:
                return None
            total = max(0.0, self.first_token_at - self.arrival)
            secs = dict(self.seconds)
        ms = {k: round(v * 1e3, 3) for k, v in secs.items()}
        return {"ms": round(total * 1e3, 3),
                "outside_model_ms": round((total - sum(secs[k] for k in MODEL_PHASES)) * 1e3, 3),
                "phases_ms": ms, "other_ms": round((total - sum(secs.values())) * 1e3, 3),
                "gc_ms": round(self._gc * 1e3, 3)}


class _Frame:
    __slots__ = ("clock", "stack")

    def __init__(self, clock: TurnClock):
        self.clock = clock
        self.stack: list[float] = []      # per open phase: the seconds its nested phases took


def current() -> TurnClock | None:
    """The clock active on this thread, or None."""
    f = getattr(_local, "frame", None)
    return f.clock if f is not None else None


@contextmanager
def active(clock: TurnClock | None):
    """Make `clock` the one ``phase`` and ``charge`` charge on this thread within the block (None: none)."""
    prev = getattr(_local, "frame", None)
    _local.frame = _Frame(clock) if clock is not None else None
    try:
        yield clock
    finally:
        _local.frame = prev


@contextmanager
def phase(name: str):
    """Time the block as phase `name` on this thread's active clock (nothing without one); the phases nested in it
    are taken out of its time."""
    f = getattr(_local, "frame", None)
    if f is None:
        yield
        return
    f.stack.append(0.0)
    t0 = time.perf_counter()
    try:
        yield
    finally:
        dt = time.perf_counter() - t0
        inner = f.stack.pop()
        f.clock.add(name, max(0.0, dt - inner))
        if f.stack:
            f.stack[-1] += dt


def charge(name: str, seconds: float) -> None:
    """Charge `seconds` (measured by the caller, not inside an open phase of this thread) to phase `name` on this
    thread's active clock, taking them out of the phase that encloses the call, if any."""
    f = getattr(_local, "frame", None)
    if f is None:
        return
    f.clock.add(name, seconds)
    if f.stack:
        f.stack[-1] += seconds
