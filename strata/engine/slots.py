"""Request slots' planning, apart from its apply: which slot a request takes (``choose_slot``), where a prompt's read
is cut into chunks (``chunk_bounds``), and what one engine step runs (``plan_step``: every decoding slot's token,
every speculating slot's verify and prefill chunks under a token budget, round-robin). Pure functions over plain
values; the engine applies the plans."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from strata.text.token_ids import common_prefix


@dataclass(frozen=True)
class SlotView:
    """What choosing a slot reads of one: its ``id``, the token ids of the conversation it holds (``tokens``; empty
    when none), ``last_used`` (a clock reading: larger is more recent) and whether a request runs in it (``busy``)."""

    id: int
    tokens: Sequence[int] = ()
    last_used: float = 0.0
    busy: bool = False


def choose_slot(slots: Sequence[SlotView], prompt: Sequence[int], id_slot: int | None = None,
                min_shared: int = 1) -> int | None:
    """The slot a request takes, the way llama-server picks one: ``id_slot`` when the request names one (ValueError
    naming the field when no slot has that id); else the idle slot whose conversation shares the longest prefix with
    `prompt` (at least min_shared tokens; ties: the least recently used); else the least recently used idle slot
    (ties: the lowest id). None when every slot is busy (the request waits). A named slot is returned busy or not:
    the caller queues the request for it."""
    if id_slot is not None:
        if not any(s.id == id_slot for s in slots):
            raise ValueError(f"id_slot {id_slot} is not a slot (slots: {', '.join(str(s.id) for s in slots)})")
        return id_slot
    idle = [s for s in slots if not s.busy]
    if not idle:
        return None
    shared = {s.id: common_prefix(s.tokens, prompt) if len(s.tokens) and len(prompt) else 0 for s in idle}
    best = max(shared.values())
    if best >= max(1, min_shared):
        return min((s for s in idle if shared[s.id] == best), key=lambda s: (s.last_used, s.id)).id
    return min(idle, key=lambda s: (s.last_used, s.id)).id


def chunk_bounds(start: int, end: int, chunk: int, cuts: Sequence[int] = ()) -> list[tuple[int, int]]:
    """The parts [a, b) a prompt's read of positions [start, end) is cut into: at every multiple of `chunk` counted
    from `start` and at every cut point strictly inside (a checkpoint's position). They depend only on the request's
    own positions, never on what else runs, so a prompt read beside others is read in the very parts it is read in
    alone (the same bits). ValueError for chunk < 1 or end < start."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1 (got {chunk})")
    if end < start:
        raise ValueError(f"a read of [{start}, {end}) ends before it starts")
    marks = set(range(start + chunk, end, chunk)) | {int(c) for c in cuts if start < c < end}
    edges = [start] + sorted(marks) + [end]
    return [(a, b) for a, b in zip(edges, edges[1:]) if b > a]


@dataclass(frozen=True)
class SlotWork:
    """One active slot as a step sees it: ``id``; ``chunks`` still to read of its prompt (chunk_bounds' parts, in
    order; empty once it decodes); ``verify``, the tokens of the speculative verify it waits on (its sampled token
    and its drafts, one short read; 0: a one-token decode, or a prompt part)."""

    id: int
    chunks: tuple[tuple[int, int], ...] = ()
    verify: int = 0

    @property
    def decoding(self) -> bool:
        return not self.chunks and not self.verify


@dataclass(frozen=True)
class StepPlan:
    """What one engine step runs: ``decode``, the slots that read one token each (the batched decode step), in slot
    order; ``verify``, (slot, tokens) speculative verifies, each its own short read, in slot order; ``prefill``,
    (slot, a, b) prompt parts read this step, one per slot at most; ``cursor``, where the next step's round-robin
    over prefilling slots starts; ``tokens``, what the step reads in all."""

    decode: tuple[int, ...] = ()
    prefill: tuple[tuple[int, int, int], ...] = ()
    cursor: int = 0
    tokens: int = field(default=0)
    verify: tuple[tuple[int, int], ...] = ()


def plan_step(work: Sequence[SlotWork], budget: int, cursor: int = 0) -> StepPlan:
    """One step of continuous batching: every decoding slot reads its next token and every speculating slot runs
    its verify (neither is ever deferred, so a long prompt cannot stall the others' answers), then prompt parts
    (each slot's next chunk, whole) go to the prefilling slots in round-robin order from the first slot id >=
    cursor, while they fit in what is left of `budget` tokens after the decodes and the verifies; at least one part
    runs when any slot is prefilling (no prompt waits forever behind decodes). The next cursor is one past the last
    slot served, so every prefilling slot is served within as many steps as there are prefilling slots. ValueError
    for budget < 1, repeated slot ids or a slot both verifying and reading its prompt."""
    if budget < 1:
        raise ValueError(f"the step's token budget must be >= 1 (got {budget})")
    ids = [w.id for w in work]
    if len(set(ids)) != len(ids):
        raise ValueError(f"slot ids repeat in {ids}")
    bad = next((w.id for w in work if w.verify < 0 or (w.verify and w.chunks)), None)
    if bad is not None:
        raise ValueError(f"slot {bad}: a verify is a count of tokens >= 1, and a slot reading its prompt has none")
    decode = tuple(sorted(w.id for w in work if w.decoding))
    verify = tuple(sorted((w.id, int(w.verify)) for w in work if w.verify))
    left = budget - len(decode) - sum(n for _, n in verify)
    pre = sorted((w for w in work if w.chunks), key=lambda w: w.id)
    order = [w for w in pre if w.id >= cursor] + [w for w in pre if w.id < cursor]
    parts: list[tuple[int, int, int]] = []
    nxt = cursor
    for w in order:
        a, b = w.chunks[0]
        if b - a > left and parts:      # the first part runs whatever is left (progress); the rest must fit
            break
        parts.append((w.id, a, b))
        left -= b - a
        nxt = w.id + 1
        if left <= 0:
            break
    return StepPlan(decode=decode, prefill=tuple(parts), cursor=nxt if parts else cursor,
                    tokens=len(decode) + sum(n for _, n in verify) + sum(b - a for _, a, b in parts), verify=verify)


def slot_error(slot, n_slots: int) -> str:
    """The one line refusing an id_slot that names none of n_slots request slots (-1: any slot)."""
    if n_slots == 1:
        return f"'id_slot' must be 0 or -1 (this server has one slot), got {slot!r}"
    return (f"'id_slot' must be -1 (any slot) or a slot id in 0..{n_slots - 1} (this server has {n_slots} slots), "
            f"got {slot!r}")
