"""The engine thread: loads the Engine, runs generations from a bounded FIFO (one at a time, or with --parallel N up to N
in the engine's request slots, stepped together), streams events to asyncio.

The event loop never calls into the model. A request is a Job: the loop submits it (QueueFull beyond
--queue-max waiting jobs), the engine thread runs it (`engine.generate(job.request)`, or with several slots
`engine.admit` and `engine.step` until it ends) and hands each TokenEvent / FinalEvent to the job's asyncio.Queue
with loop.call_soon_threadsafe (with several slots, every job's events of one engine step in one such call: one
loop hop per step, not per token). Setting the request's cancel event stops generation between two tokens (the engine
checks it); a job cancelled while still waiting is dropped without touching the engine. Calls (fn(engine)) run in
turn between engine steps.
"""
from __future__ import annotations

import asyncio
import collections
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import structlog

from strata.engine import turn_clock
from strata.engine.types import FinalEvent
from strata.errors import EngineFault, Unavailable

log = structlog.get_logger("strata.serve.worker")


class QueueFull(Exception):
    """More than queue_max requests are already waiting."""


class ShuttingDown(Exception):
    """The daemon is draining and takes no new work."""


@dataclass
class EngineError:
    """An exception raised by the engine while running a job (delivered in place of events)."""
    exc: BaseException


@dataclass(eq=False)
class Job:
    """One queued unit of work; jobs are equal only to themselves (the queue removes a dropped one by identity)."""
    request: Any                          # strata.engine GenerationRequest (has .cancel: threading.Event)
    events: asyncio.Queue
    request_id: str = ""
    accepted_at: float = field(default_factory=time.perf_counter)
    started_at: float | None = None
    first_token_at: float | None = None
    state: str = "waiting"                # waiting -> running -> done | dropped
    fn: Callable[[Any], Any] | None = None  # a call to run on the engine thread instead of a generation
    stop: threading.Event | None = None   # a call's own cancel event (fn watches it)
    slot: int | None = None               # the request slot it runs in (several slots); a call's: it waits for it
    last_token_at: float | None = None

    def cancel(self) -> None:
        for c in (getattr(self.request, "cancel", None), self.stop):
            if c is not None:
                c.set()


class EngineWorker:
    """One engine, one thread, one FIFO of at most `queue_max` waiting jobs (plus those running: one, or one per
    request slot)."""

    def __init__(self, engine_factory: Callable[[], Any], *, queue_max: int, metrics, loop: asyncio.AbstractEventLoop):
        if queue_max < 0:
            raise ValueError(f"queue_max must be >= 0, got {queue_max}")
        self._factory = engine_factory
        self.queue_max = queue_max
        self.metrics = metrics
        self.loop = loop
        self.engine = None
        self.load_error: BaseException | None = None
        self.loaded = loop.create_future()
        self._cv = threading.Condition()
        self._waiting: collections.deque[Job] = collections.deque()
        self._active: list[Job] = []          # the jobs running (one per busy request slot)
        self._progress = time.monotonic()     # the latest job start, or the moment work arrived at an idle engine
        self._stop = False
        self._held: list | None = None        # (queue, item) posted during an engine step of several slots (_post)
        self.closing = False
        self._thread = threading.Thread(target=self._main, name="strata-engine", daemon=True)

    # ---------------------------------------------------------------- loop side
    def start(self) -> None:
        self._thread.start()

    @property
    def waiting(self) -> int:
        with self._cv:
            return len(self._waiting)

    @property
    def running(self) -> Job | None:
        """The first job running, or None."""
        active = self._active
        return active[0] if active else None

    @property
    def active(self) -> list[Job]:
        """The jobs running now (a copy)."""
        return list(self._active)

    @property
    def n_running(self) -> int:
        return len(self._active)

    @property
    def slots(self) -> int:
        """Requests that run at once: the engine's request slots (1 until it is loaded)."""
        return int(getattr(self.engine, "parallel", 1) or 1)

    def submit(self, request, request_id: str = "") -> Job:
        """Queue a generation; raises QueueFull or ShuttingDown. Call from the event loop."""
        job = Job(request=request, events=asyncio.Queue(), request_id=request_id)
        return self._enqueue(job)

    def call(self, fn: Callable[[Any], Any], request_id: str = "", stop: threading.Event | None = None,
             slot: int | None = None) -> Job:
        """Queue fn(engine) to run on the engine thread in turn (and, slot named, once that request slot is idle: it
        waits in its place meanwhile); its result arrives as the only event. stop: set when the job is cancelled
        (fn may watch it to end early)."""
        job = Job(request=None, events=asyncio.Queue(), request_id=request_id, fn=fn, stop=stop, slot=slot)
        return self._enqueue(job)

    def _enqueue(self, job: Job) -> Job:
        with self._cv:
            if self.closing:
                raise ShuttingDown("the server is shutting down")
            n_wait, n_run = len(self._waiting), len(self._active)
            if n_wait + n_run > self.queue_max + self.slots - 1:
                # the count, not the split: requests just accepted wait until the engine thread admits them to a
                # free slot between steps
                slots = f"{self.slots} slot{'s' if self.slots != 1 else ''}"
                raise QueueFull(f"{n_run} running, {n_wait} waiting: at most {self.queue_max + self.slots} at once "
                                f"({slots} and --queue-max {self.queue_max})")
            if not self._waiting and not self._active:
                self._progress = time.monotonic()
            self._waiting.append(job)
            self.metrics.queue_depth.set(len(self._waiting))
            self._cv.notify()
        return job

    def stuck(self, bound: float) -> str | None:
        """Why the engine thread counts as stuck, or None: work is running or waiting, and for more than `bound`
        seconds no forward call has returned, no job has started and no work has arrived at an idle engine (bound
        <= 0: never stuck)."""
        if bound <= 0 or self.engine is None:
            return None
        with self._cv:
            n_run, n_wait, last = len(self._active), len(self._waiting), self._progress
        if not n_run and not n_wait:
            return None
        returned = getattr(self.engine, "forward_returned_at", None)
        if returned is not None:
            last = max(last, returned())
        idle = time.monotonic() - last
        if idle <= bound:
            return None
        return (f"the engine thread is stuck: no forward call has returned for {idle:.0f} s (--stall-seconds "
                f"{bound:g}) with {n_run} request{'s' if n_run != 1 else ''} running and {n_wait} waiting")

    def drop(self, job: Job) -> None:
        """Cancel a job: drop it if waiting, else ask the engine to stop it between tokens."""
        job.cancel()
        with self._cv:
            if job.state == "waiting":
                self._waiting.remove(job)
                job.state = "dropped"
                self.metrics.queue_depth.set(len(self._waiting))

    def begin_shutdown(self) -> list[Job]:
        """Refuse new jobs; return the jobs that were still waiting (removed from the queue)."""
        with self._cv:
            self.closing = True
            dropped = list(self._waiting)
            self._waiting.clear()
            for j in dropped:
                j.state = "dropped"
            self.metrics.queue_depth.set(0)
        return dropped

    def stop(self, timeout: float | None = None) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout)

    # ---------------------------------------------------------------- engine thread
    def _post(self, job: Job, item) -> None:
        """Hand `item` to the job's queue on the event loop: at once, or while ``_held`` is a list (an engine step of
        several slots running) appended to it, every job's items of the step then carried by one loop hop
        (``_flush``) instead of one per token."""
        if self._held is not None:
            self._held.append((job.events, item))
            return
        try:
            self.loop.call_soon_threadsafe(job.events.put_nowait, item)
        except RuntimeError:  # loop closed during shutdown
            pass

    def _flush(self) -> None:
        """The items held during a step, to their queues in one loop hop (each job's in order)."""
        held, self._held = self._held, []
        if held:
            try:
                self.loop.call_soon_threadsafe(_put_all, held)
            except RuntimeError:  # loop closed during shutdown
                pass

    def _main(self) -> None:
        try:
            self.engine = self._factory()
        except BaseException as e:  # noqa: BLE001 - reported to the loop, which exits with it
            self.load_error = err = e
            self.loop.call_soon_threadsafe(lambda: self.loaded.done() or self.loaded.set_exception(err))
            return
        self.loop.call_soon_threadsafe(lambda: self.loaded.done() or self.loaded.set_result(self.engine))
        if self.slots > 1:
            self._serve_slots()
            return
        while True:
            with self._cv:
                while not self._waiting and not self._stop:
                    self._cv.wait()
                if self._stop and not self._waiting:
                    return
                job = self._waiting.popleft()
                job.state = "running"
                self._active.append(job)
                self._progress = time.monotonic()
                self.metrics.queue_depth.set(len(self._waiting))
                self.metrics.running.set(1)
            try:
                with structlog.contextvars.bound_contextvars(request_id=job.request_id):
                    if job.fn is not None:
                        self._run_call(job)
                    else:
                        self._run_generation(job)
            finally:
                with self._cv:
                    job.state = "done"
                    self._active.remove(job)
                    self.metrics.running.set(0)

    def _serve_slots(self) -> None:
        """The engine thread with several request slots: between engine steps, the calls waiting run in turn and
        waiting generations are admitted to slots (Engine.admit; one whose slot is busy waits on, in its place in
        the FIFO); then one step (Engine.step) over every busy slot, each job's events posted as they come."""
        eng = self.engine
        self._held = []
        try:
            self._slot_loop(eng)
        finally:
            self._flush()
            self._held = None

    def _slot_loop(self, eng) -> None:
        while True:
            with self._cv:
                while not self._waiting and not self._active and not self._stop:
                    self._cv.wait()
                if self._stop and not self._waiting and not self._active:
                    return
                calls, gens = _take_waiting(eng, self._waiting, eng.scheduler.busy < self.slots)
                if calls or gens:
                    self.metrics.queue_depth.set(len(self._waiting))
            for job in calls:
                with structlog.contextvars.bound_contextvars(request_id=job.request_id):
                    self._run_call(job)
                with self._cv:
                    job.state = "done"
            if calls:
                self._flush()
            back = [job for job in gens if not self._admit(job)]
            if back:
                with self._cv:
                    for job in reversed(back):          # still waiting, in their places at the front
                        job.state = "waiting"
                        self._waiting.appendleft(job)
                    self.metrics.queue_depth.set(len(self._waiting))
            try:
                ran = eng.step()
            except BaseException as e:  # noqa: BLE001 - a fault outside any one request's reads: theirs all end
                log.error("engine step failed", error=f"{type(e).__name__}: {e}", exc_info=True)
                eng.scheduler.cancel_all(e)
                ran = 0
            self._flush()                        # the step's events (every slot's token), one loop hop
            if ran == 0 and not calls and (back or self._waiting):
                with self._cv:                   # every slot they name is busy but none is running: wait for work
                    if not self._active:
                        self._cv.wait(0.05)

    def _admit(self, job: Job) -> bool:
        """Put a waiting generation in a request slot -> False when its slot is busy (it waits on)."""
        job.started_at = time.perf_counter()
        clock = getattr(job.request, "clock", None)
        if clock is not None:
            clock.set("queue", job.started_at - job.accepted_at)      # its latest try counts
        with self._cv:
            job.state = "running"
            self._active.append(job)
            self.metrics.running.set(len(self._active))
        try:
            with structlog.contextvars.bound_contextvars(request_id=job.request_id):
                slot = self.engine.admit(job.request, lambda ev: self._deliver(job, ev),
                                         lambda err: self._done(job, err))
        except BaseException as e:  # noqa: BLE001 - refused before it started (a slot that does not exist)
            slot = -1
            self._done(job, e)
        if slot is None:
            with self._cv:
                self._active.remove(job)
                self.metrics.running.set(len(self._active))
            return False
        if slot >= 0:
            job.slot = slot
            self._progress = time.monotonic()
        return True

    def _done(self, job: Job, err: BaseException | None) -> None:
        """A job running in a slot ended (err: what it raised, delivered in place of events)."""
        if err is not None:
            self._failed(job, err)
        with self._cv:
            job.state = "done"
            if job in self._active:
                self._active.remove(job)
            self.metrics.running.set(len(self._active))

    def _deliver(self, job: Job, ev) -> None:
        """One event of a running generation to its job (metrics counted: finals, first token, token gaps)."""
        now = time.perf_counter()
        clock = getattr(job.request, "clock", None)
        if clock is not None:
            clock.engine_done(now)      # the engine's part of the turn ends at its first event (TurnClock)
        if isinstance(ev, FinalEvent):
            self.metrics.observe_final(dict(ev.usage or {}), dict(ev.timings or {}),
                                       dict(getattr(ev, "strata", None) or {}), ev.finish_reason)
            log.info("generation finished", finish_reason=ev.finish_reason,
                     prompt_n=(ev.timings or {}).get("prompt_n"),
                     cache_n=(ev.timings or {}).get("cache_n"),
                     predicted_n=(ev.timings or {}).get("predicted_n"),
                     queue_ms=round((job.started_at - job.accepted_at) * 1e3, 2),
                     resume_from=(getattr(ev, "strata", None) or {}).get("resume_from"),
                     id_slot=(getattr(ev, "strata", None) or {}).get("id_slot"))
        else:
            if job.last_token_at is None:
                job.first_token_at = now
                self.metrics.ttft.observe(now - job.accepted_at)
            else:
                self.metrics.token_latency.observe(now - job.last_token_at)
            job.last_token_at = now
        self._post(job, ev)

    def _failed(self, job: Job, e: BaseException) -> None:
        """A generation that raised: logged, counted, its error delivered in place of events."""
        if isinstance(e, Unavailable):     # e.g. a stage link down: expected, said in one line
            log.warning("generation failed: a remote stage is unavailable", error=str(e))
        else:
            log.error("generation failed", error=f"{type(e).__name__}: {e}",     # a fault with its own status
                      exc_info=not isinstance(e, (ValueError, EngineFault)))
        self.metrics.finished.labels(finish_reason="error").inc()
        self._post(job, EngineError(e))

    def _run_call(self, job: Job) -> None:
        try:
            self._post(job, ("result", job.fn(self.engine)))
        except BaseException as e:  # noqa: BLE001
            self._post(job, EngineError(e))

    def _run_generation(self, job: Job) -> None:
        job.started_at = time.perf_counter()
        clock = getattr(job.request, "clock", None)
        try:
            with turn_clock.active(clock):
                if clock is not None:
                    clock.add("queue", job.started_at - job.accepted_at)
                for ev in self.engine.generate(job.request):
                    self._deliver(job, ev)
        except BaseException as e:  # noqa: BLE001 - the engine must stay up for the next request
            self._failed(job, e)


def _put_all(held: list) -> None:
    """On the event loop: each (queue, item) put, in order."""
    for q, item in held:
        q.put_nowait(item)


def _take_waiting(engine, waiting, free: bool) -> tuple[list[Job], list[Job]]:
    """Under the worker's lock: the calls that may run now (_ready_calls) and, when a slot is free (`free`), every
    waiting generation, each taken out of `waiting` (state "admitting") -> (calls, generations), both in order."""
    if not waiting:
        return [], []
    calls = _ready_calls(engine, waiting)
    gens = [j for j in waiting if j.fn is None] if free else []
    for j in calls + gens:
        waiting.remove(j)
        j.state = "admitting"
    return calls, gens


def _ready_calls(engine, waiting) -> list[Job]:
    """The waiting calls that may run now, in order: one that names no slot, or names an idle slot that no job
    before it in the queue is waiting for (a request naming it with id_slot, or a call on it: they keep their order,
    as llama-server takes its deferred tasks)."""
    slots = getattr(engine, "slots", None) or []
    ready, claimed = [], set()
    for j in waiting:
        if j.fn is None:
            sid = getattr(j.request, "id_slot", None)
            if isinstance(sid, int) and sid >= 0:
                claimed.add(sid)
        elif j.slot is None or (j.slot not in claimed and not (0 <= j.slot < len(slots) and slots[j.slot].busy)):
            ready.append(j)
        else:
            claimed.add(j.slot)
    return ready
