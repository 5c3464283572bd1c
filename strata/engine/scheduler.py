"""The request slots and continuous batching over them: which slot a request runs in (strata.engine.slots.choose_slot)
and the engine step (slots.plan_step's plan, then applied: one batched decode step for every decoding slot, each
speculating slot's verify, whole prompt parts under the step's token budget), each request a generator advanced
from one read to the next."""
from __future__ import annotations

import contextvars
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import structlog

from strata.engine import turn_clock
from strata.engine.slots import SlotView, SlotWork, choose_slot, plan_step
from strata.engine.speculate import MAX_DRAFTS, SpecCounts
from strata.engine.types import FinalEvent, Picked, ReadPart, ReadToken, ReadVerify, TokenEvent
from strata.sampling.device import greedy_picks
from strata.stages.batch import decode_batch, verify_batch

log = structlog.get_logger("strata.engine")

#: rows one batched verify reads at most: the verifies of several slots go through each weight together up to
#: this many rows (where every row's product is that row's alone: the size of one slot's largest verify)
VERIFY_ROWS = MAX_DRAFTS + 1


@dataclass(eq=False)
class Run:
    """One request running in a slot: its generator (events, and the reads it waits on), where its events go
    (``on_event(item)``; ``on_done(None | exception)`` once at the end), the read it waits on (``pending``), the
    context it runs in (``context``: a copy of the one it was admitted in, its request id bound for its log lines)."""

    gen: Any
    on_event: Callable[[Any], None]
    on_done: Callable[[BaseException | None], None]
    request: Any = None
    task: int = 0
    pending: ReadToken | ReadVerify | ReadPart | None = None
    n_decoded: int = 0
    started_at: float = field(default_factory=time.monotonic)
    context: contextvars.Context = field(default_factory=contextvars.copy_context)


@dataclass(eq=False)
class Slot:
    """One request slot: its live sequence (``seq``) with the reader and decoder over it, the request running in it
    (``run``, or None when idle), when it last finished one (``last_used``, a time.monotonic reading), the id of
    the last request it took (``task``: llama-server's id_task) and what its drafter drafted and the verifies kept
    since the start (``spec``: SpecCounts, every choice run in this slot)."""

    id: int
    seq: Any
    reader: Any
    decoder: Any
    run: Run | None = None
    last_used: float = 0.0
    task: int = -1
    spec: SpecCounts = field(default_factory=SpecCounts)

    @property
    def busy(self) -> bool:
        return self.run is not None

    def view(self) -> SlotView:
        return SlotView(self.id, self.seq.ids, self.last_used, self.busy)


class Scheduler:
    """The engine's request slots and its step. ``admit`` puts a request in a slot (the one choose_slot picks);
    ``step`` runs one engine step over every busy slot. `start(slot, request, prompt)` makes a request's generator (the
    engine's), which yields events and ReadToken / ReadVerify / ReadPart reads; `budget`: tokens one step reads at
    most (decodes and verifies first, then prompt parts; one part always runs). Runs on the engine thread only;
    ``slots`` and ``stats`` may be read from any."""

    def __init__(self, slots: list[Slot], start: Callable[[Slot, Any, Any], Any], budget: int):
        self.slots = slots
        self.start = start
        self.budget = int(budget)
        self.cursor = 0
        self.tasks = 0
        # steps run, steps whose decode read several slots' tokens in one batched step, the rows of those, the
        # most rows one step decoded, the rows whose greedy pick was taken with the others', prompt parts read,
        # requests admitted, speculative verifies run, the tokens they read and the batched verifies that read
        # several slots' at once
        self.stats = dict(steps=0, batched_steps=0, batched_rows=0, max_rows=0, picked_rows=0, prefill_parts=0,
                          admitted=0, verifies=0, verify_tokens=0, batched_verifies=0)

    @property
    def busy(self) -> int:
        return sum(s.busy for s in self.slots)

    def new_task(self, slot: Slot) -> int:
        """The next task id (llama-server's id_task), now `slot`'s last: every request counts, those a lone slot
        runs outside the scheduler's steps too."""
        self.tasks += 1
        slot.task = self.tasks
        return self.tasks

    def admit(self, request, prompt, on_event, on_done) -> Slot | None:
        """Put `request` (its prompt token ids `prompt`) in a slot: its id_slot when it names one, else the idle slot
        sharing the longest prefix with the prompt, else the least recently used idle one -> the slot, or None
        when that slot is busy (the request waits; nothing changes). ValueError naming id_slot for a slot that
        does not exist."""
        i = choose_slot([s.view() for s in self.slots], prompt, getattr(request, "id_slot", None))
        if i is None or self.slots[i].busy:
            return None
        slot = self.slots[i]
        task = self.new_task(slot)
        slot.run = Run(self.start(slot, request, prompt), on_event, on_done, request=request, task=task)
        self.stats["admitted"] += 1
        self._advance(slot, None, None)       # to its first read: the resume (restore, cut back, park) runs here
        return slot

    def step(self) -> int:
        """One engine step: the plan (every decoding slot's token, every speculating slot's verify; prompt parts
        round-robin under what is left of the budget), then its reads (the decodes in one batched step, each verify
        a read of its own, the parts), then each slot served advanced to its next read -> tokens read (0: no slot
        was busy). One busy slot waiting on one token is read at once, as a request alone is (no plan)."""
        busy = [s for s in self.slots if s.busy]
        if len(busy) == 1 and isinstance(busy[0].run.pending, ReadToken):    # one slot decoding: its read alone
            slot = busy[0]
            self.stats["steps"] += 1
            self._advance(slot, *self._decode(busy, 1)[slot.id])
            return 1
        work = [_work(s) for s in busy]
        if not work:
            return 0
        plan = plan_step(work, self.budget, self.cursor)
        self.cursor = plan.cursor
        t0 = time.perf_counter()
        results = self._decode([self.slots[i] for i in plan.decode], len(plan.decode) + len(plan.verify))
        own = dict.fromkeys(plan.decode, time.perf_counter() - t0)       # each row's share: the whole batched step
        for group in _groups(plan.verify, VERIFY_ROWS):     # the slots' verifies, batched up to VERIFY_ROWS rows
            t1 = time.perf_counter()
            results.update(self._verify([self.slots[i] for i in group]))
            own.update(dict.fromkeys(group, time.perf_counter() - t1))
        for i, _, _ in plan.prefill:
            slot = self.slots[i]
            t1 = time.perf_counter()
            with turn_clock.active(getattr(slot.run.request, "clock", None)):
                results[i] = slot.run.context.run(_call, lambda: slot.reader.read_part(slot.run.pending))
            own[i] = time.perf_counter() - t1
        spent = time.perf_counter() - t0
        for s in self.slots:       # the time a request waited on the others' reads of this step (before its first token)
            clock = getattr(s.run.request, "clock", None) if s.run is not None else None
            if clock is not None and spent > own.get(s.id, 0.0):
                clock.add("slots", spent - own.get(s.id, 0.0))
        self.stats["steps"] += 1
        self.stats["prefill_parts"] += len(plan.prefill)
        self.stats["verifies"] += len(plan.verify)
        self.stats["verify_tokens"] += sum(n for _, n in plan.verify)
        for i in sorted(results):
            self._advance(self.slots[i], *results[i])
        return plan.tokens

    def _decode(self, slots: list[Slot], decoding: int) -> dict[int, tuple]:
        """Each slot's pending token read: one slot's in its own forward call, several in one batched step ->
        {slot id: (what its ReadToken is answered with, None) or (None, the exception)}; a slot whose pool has no
        room for its token fails alone. A ReadToken asking for its hidden row (an MTP drafter's) or its time gets
        (logits, that row or None, the seconds of the forward it was read in over `decoding`, the slots decoding
        this step, verifies included): its share of the step the decoding slots would share if none drafted, what
        its adaptive policy prices a plain step at (a verify at its rows' share of the batched verify it ran in,
        _verify)."""
        if len(slots) == 1:
            s = slots[0]
            res = _call(lambda: s.decoder.read(s.run.pending))
            if s.run.pending.triple and res[1] is None:
                logits, h, secs = res[0]
                res = ((logits, h, secs / max(1, decoding)), None)
            return {s.id: res}
        out: dict[int, tuple] = {}
        ok = []
        for s in slots:
            res = _call(lambda: s.seq.reserve(1))
            if res[1] is not None:
                out[s.id] = res
            else:
                ok.append(s)
        if len(ok) == 1:
            return {**out, **self._decode(ok, decoding)}
        if ok:
            hidden = any(s.run.pending.hidden for s in ok)
            on_device = all(s.run.pending.on_device for s in ok)     # the logits stay where the rows sample
            t0 = time.perf_counter()
            rows = _call(lambda: decode_batch([s.seq for s in ok], [s.run.pending.token for s in ok], hidden=hidden,
                                              on_device=on_device))
            # a failure here leaves every row to its own sampler, which meets it in its own request
            picks = (_call(lambda: _picks(ok, rows[0][0] if hidden else rows[0]))[0] or {}) if rows[1] is None else {}
            dt = time.perf_counter() - t0        # the picks' copy waits for the device's step
            self.stats["picked_rows"] += len(picks)
            for r, s in enumerate(ok):
                if rows[1] is not None:
                    out[s.id] = rows
                    continue
                logits, h = rows[0] if hidden else (rows[0], None)
                p = s.run.pending
                share = dt / max(len(ok), decoding)
                if r in picks:
                    row = Picked(picks[r])
                else:
                    row = _device_row(s.seq, logits[r]) if p.on_device else logits[r]
                out[s.id] = ((row, h[r:r + 1] if p.hidden else None, share) if p.triple else row, None)
            if rows[1] is None:
                self.stats["batched_steps"] += 1
                self.stats["batched_rows"] += len(ok)
                self.stats["max_rows"] = max(self.stats["max_rows"], len(ok))
        return out

    def _verify(self, slots: list[Slot]) -> dict[int, tuple]:
        """Each slot's pending verify: one slot's as its own short read (its decoder times it), several in one
        batched verify -> {slot id: ((rows, final-normed rows, seconds), None) or (None, the exception)}, seconds
        a batched verify's time shared by its rows; a slot whose pool has no room for its tokens fails alone."""
        if len(slots) == 1:
            s = slots[0]
            return {s.id: _call(lambda: s.decoder.read(s.run.pending))}
        out: dict[int, tuple] = {}
        ok = []
        for s in slots:
            res = _call(lambda: s.seq.reserve(len(s.run.pending.tokens)))
            if res[1] is not None:
                out[s.id] = res
            else:
                ok.append(s)
        if len(ok) == 1:
            return {**out, **self._verify(ok)}
        if ok:
            t0 = time.perf_counter()
            res = _call(lambda: verify_batch([s.seq for s in ok], [s.run.pending.tokens for s in ok]))
            dt = time.perf_counter() - t0
            total = sum(len(s.run.pending.tokens) for s in ok)
            for r, s in enumerate(ok):
                if res[1] is not None:
                    out[s.id] = res
                else:
                    rows, h = res[0][r]
                    if s.run.pending.on_device:      # judged as a lone verify's device rows are (_device_row)
                        rows = _device_row(s.seq, rows)
                    out[s.id] = ((rows, h, dt * len(s.run.pending.tokens) / total), None)
            if res[1] is None:
                self.stats["batched_verifies"] += 1
        return out

    def _advance(self, slot: Slot, value, error: BaseException | None) -> None:
        """Send `value` (or throw `error`) into the slot's request and take its events until it asks for its next read
        (kept as pending) or ends (the slot is free again). A FinalEvent is held until the request yields again: the
        request's last one reaches its client only once the slot is free, so a client that has its answer finds
        the slot idle (a slot action, /slots)."""
        run = slot.run
        run.pending = None
        held: list = [None]
        try:
            with turn_clock.active(getattr(run.request, "clock", None)):     # its plan, checkpoints, sampling
                run.pending = run.context.run(_take, run, value, error, held)
        except StopIteration:
            self._finish(slot, None, held[0])
        except BaseException as e:  # noqa: BLE001 - the request's error, delivered to its client
            self._finish(slot, e, held[0])

    def _finish(self, slot: Slot, error: BaseException | None, final=None) -> None:
        """The slot freed, then its request's last FinalEvent (if held) and its end delivered."""
        run, slot.run = slot.run, None
        slot.last_used = time.monotonic()
        run.context.run(_end, run, error, final)

    def cancel_all(self, error: BaseException) -> None:
        """End every running request with `error` (its generator closed, its cleanup run; on_done(error) for each)."""
        for s in self.slots:
            if s.run is not None:
                run = s.run
                try:
                    run.gen.close()
                except BaseException:  # noqa: BLE001 - its cleanup failed too: the error stands
                    pass
                self._finish(s, error)

    def status(self) -> list[dict]:
        """Each slot as /slots shows it (llama-server's fields where Strata has them; n_prompt_tokens as llama-server
        counts it: the tokens in the slot's cache, prompt and answer, idle or not, so a slot that served a request
        shows what it holds)."""
        out = []
        for s in self.slots:
            run = s.run
            req = run.request if run is not None else None
            max_tokens = getattr(req, "max_tokens", None)
            out.append({"id": s.id, "id_task": s.task, "is_processing": run is not None,
                        "phase": None if run is None else
                        ("prompt" if isinstance(run.pending, ReadPart) else "decode"),
                        "pos": int(s.seq.pos),
                        "n_prompt_tokens": int(s.seq.pos),      # llama-server's: the tokens the slot's cache holds
                        "next_token": {"has_next_token": run is not None, "n_decoded": run.n_decoded if run else 0,
                                       "n_remain": (max_tokens - run.n_decoded) if run is not None and
                                       max_tokens is not None else -1}})
            if s.decoder.drafter is not None:     # --spec: this slot's own drafts, and what its policy believes
                adaptive = s.decoder.adaptive
                out[-1]["spec"] = {"drafted": s.spec.drafted, "accepted": s.spec.accepted,
                                   "verifies": s.spec.verifies, "acceptance_rate": s.spec.acceptance,
                                   "mean_accepted": s.spec.mean_accepted,
                                   "policy": adaptive.snapshot() if adaptive is not None else None}
        return out


def _take(run: Run, value, error: BaseException | None, held: list):
    """Scheduler._advance's part in the request's context: `value` sent (or `error` thrown) into its generator, its
    events delivered until its next read -> that read. The last FinalEvent seen is kept in ``held[0]`` until another
    item follows it (StopIteration: the request ended, its final still held)."""
    item = run.gen.throw(error) if error is not None else run.gen.send(value)
    while not isinstance(item, (ReadToken, ReadVerify, ReadPart)):
        if held[0] is not None:
            run.on_event(held[0])
            held[0] = None
        if isinstance(item, FinalEvent):
            held[0] = item
        else:
            run.n_decoded += isinstance(item, TokenEvent)
            run.on_event(item)
        item = next(run.gen)
    if held[0] is not None:
        run.on_event(held[0])
        held[0] = None
    return item


def _end(run: Run, error: BaseException | None, final) -> None:
    """A request's held FinalEvent (if any), then its end, delivered (in its context)."""
    if final is not None:
        run.on_event(final)
    run.on_done(error)


def _work(slot: Slot) -> SlotWork:
    """What a busy slot's pending read is, as plan_step sees it."""
    p = slot.run.pending
    if isinstance(p, ReadPart):
        return SlotWork(slot.id, ((p.a, p.b),))
    return SlotWork(slot.id, verify=len(p.tokens) if isinstance(p, ReadVerify) else 0)


def _groups(verifies, rows: int) -> list[list[int]]:
    """plan_step's (slot, tokens) verifies in groups of at most `rows` tokens each, in slot order -> [[slot, ...]]."""
    out: list[list[int]] = []
    used = rows
    for i, n in verifies:
        if used + n > rows:
            out.append([])
            used = 0
        out[-1].append(i)
        used += n
    return out


def _picks(slots: list[Slot], logits) -> dict[int, int]:
    """The greedy picks of a batched step's rows whose choice takes one (ReadToken.pick), taken together: {row:
    token}; a row holding a NaN is left out (its choice's sampler sees the row and refuses it)."""
    rows = [r for r, s in enumerate(slots) if s.run.pending.pick]
    if not rows:
        return {}
    picks = greedy_picks(logits[rows] if len(rows) < len(slots) else logits)
    return {r: t for r, t in zip(rows, picks) if t is not None}


def _device_row(seq, row):
    """A batched step's (or verify's) rows of logits for a choice that samples on the last stage's device: host rows
    copied there (rows already there as they are), so its sampler draws as it does from a lone read's device rows
    (the bits are the same; the draw on the device and the host's array path are different algorithms)."""
    be = getattr(seq.stages[-1], "backend", None)
    if be is None or getattr(be, "device", None) is None or not isinstance(row, np.ndarray):
        return row
    with be.device:
        return be.xp.asarray(row)


def _call(fn) -> tuple:
    """(fn(), None), or (None, the exception fn raised)."""
    try:
        return fn(), None
    except BaseException as e:  # noqa: BLE001 - handed to the request whose read it was
        return None, e
