"""Reading a request's prompt into the live sequence: the conversation store puts the sequence where the prompt is
read from (ConversationStore.resume), then the parts are read in ubatch-sized forward calls and checkpoints noted
where the plan says."""
from __future__ import annotations

import time

import numpy as np
import structlog

from strata.cache.store import ConversationStore
from strata.engine import turn_clock
from strata.engine.slots import chunk_bounds
from strata.engine.types import GenerationRequest, ReadPart, run_reads
from strata.stages.sequence import Sequence

log = structlog.get_logger("strata.engine")


class PromptReader:
    """Reads prompts into `seq` (the engine's live sequence) through the conversation `store`, `ubatch` tokens per
    forward call. The engine calls it under its lock."""

    def __init__(self, seq: Sequence, store: ConversationStore, ubatch: int, drafter=None, peers=None):
        self.seq, self.store, self.ubatch = seq, store, ubatch
        self.peers = peers          # () -> the other request slots' live sequences (a prefix may come from one)
        self.drafter = drafter      # an MTPDrafter sees the hidden states of every prompt token read (or None)

    def read(self, tokens: np.ndarray, start: int, end: int, cancel=None):
        """Read tokens[start:end] in ubatch-sized forward calls starting fresh at `start` -> the last token's
        logits, or None when `cancel` was set between two calls (the sequence then ends at a call boundary)."""
        return _drained(run_reads(self.read_steps(tokens, start, end, cancel), self.read_part))

    def read_part(self, r: ReadPart):
        """One forward call: r.tokens[r.a:r.b] read into the sequence -> the last token's logits (the drafter sees
        every token's hidden state)."""
        if self.drafter is None:
            with turn_clock.phase("model"):
                return self.seq.forward(r.tokens[r.a:r.b])
        with turn_clock.phase("model"):
            logits, h = self.seq.forward(r.tokens[r.a:r.b], hidden=True)
        self.drafter.observe(r.a, h)
        return logits

    def read_steps(self, tokens: np.ndarray, start: int, end: int, cancel=None):
        """``read`` as a generator: yields a ReadPart per forward call (the parts strata.engine.slots.chunk_bounds
        cuts [start, end) into at every ubatch from start: the request's own positions only), the logits sent
        back; returns the last part's logits, or None when `cancel` was set between two parts."""
        logits = None
        for a, b in chunk_bounds(start, end, self.ubatch):
            if cancel is not None and cancel.is_set():
                return None
            logits = yield ReadPart(tokens, a, b)
        if self.drafter is not None:
            self.drafter.flush()          # a checkpoint at the part's end carries the drafter's K/V
        return logits

    def one_call(self, plan, ends: list[int], start: int, n: int) -> bool:
        """Whether a read of parts `ends` from `start` runs as one forward call with its checkpoints kept inside it
        (Sequence.mark): a live continuation of several parts (PrefillPlan.continues: also after a parked conversation
        was put back) that fits one call (ubatch), on stages that keep states at marks, without a drafter (whose K/V
        follows every read's hidden states)."""
        return (plan.continues and len(ends) > 1 and n - start <= self.ubatch and self.drafter is None
                and self.seq.can_mark)

    def prefill(self, req: GenerationRequest, prompt: np.ndarray, trace: bool):
        """``steps`` with every part read at once (a request alone) -> (plan, parts, logits)."""
        return _drained(run_reads(self.steps(req, prompt, trace), self.read_part))

    def steps(self, req: GenerationRequest, prompt: np.ndarray, trace: bool):
        """Resume (ConversationStore.resume: switch, plan, restore / cut back / continue, settle), read the parts,
        note checkpoints; a generator yielding a ReadPart per forward call (its driver sends back the logits) that returns
        (plan, parts, logits).

        logits is None when req.cancel was set during the read: the sequence then ends at a forward-call
        boundary inside a part, so it is not offered for live continuation (a later read of that part must
        split it the same way as the first); checkpoints of the parts completed stay."""
        n = len(prompt)
        st, store = self.seq, self.store
        with turn_clock.phase("plan"):
            plan = store.resume(st, prompt, req.cut_points or (), checkpoint=req.checkpoint,    # cut points were
                                cache_prompt=req.cache_prompt, trace=trace,                   # checked already
                                peers=self.peers() if self.peers is not None else ())
        parts: list[tuple[int, int]] = []
        try:
            if trace:
                log.info("prefill_plan", plan=plan.describe(), checkpoints=len(store.checkpoints))
            logits = None
            start = plan.resume_pos
            ends = [e for e in plan.part_ends if start < e <= n]
            if not ends or ends[-1] != n:
                ends.append(n)
            if self.one_call(plan, ends, start, n):
                # a live continuation that fits one forward call: read at once, each checkpoint's running state kept
                # inside the call at its cut point (Memory.mark) instead of a forward call per part
                t0 = time.perf_counter()
                st.mark([e for e in ends[:-1] if e in plan.save_at])
                try:
                    logits = yield from self.read_steps(prompt, start, n, req.cancel)
                    if logits is None:
                        st.live_ok = False
                    else:
                        for end in ends:
                            parts.append((start, end))
                            kind = plan.save_at.get(end)
                            if kind is not None:
                                with turn_clock.phase("checkpoint"):
                                    store.note_at(st, kind, end)
                            start = end
                finally:
                    st.mark(())                  # disarmed; states kept but not taken are let go
                if trace:
                    log.info("prefill_one_call", start=plan.resume_pos, end=n, checkpoints=[
                        (e, plan.save_at[e]) for e in ends if e in plan.save_at],
                        ms=round((time.perf_counter() - t0) * 1000.0, 2))
                ends = []
            for end in ends:
                t0 = time.perf_counter()
                logits = yield from self.read_steps(prompt, start, end, req.cancel)
                if logits is None:
                    st.live_ok = False
                    if trace:
                        log.info("prefill_cancelled", start=start, end=end, pos=st.pos)
                    break
                parts.append((start, end))
                kind = plan.save_at.get(end)
                if kind is not None:
                    with turn_clock.phase("checkpoint"):
                        store.note(st, kind)
                if trace:
                    log.info("prefill_part", start=start, end=end, n_tokens=end - start, ubatch=self.ubatch,
                             ms=round((time.perf_counter() - t0) * 1000.0, 2), checkpoint=kind)
                start = end
        except BaseException:
            # a failed or interrupted read leaves the arena partly written: start the next request from 0
            store.forget(st)
            raise
        return plan, parts, logits


def _drained(gen):
    """What a generator that yields nothing returns (run_reads over a prompt read, whose reads are all served)."""
    try:
        item = next(gen)
    except StopIteration as stop:
        return stop.value
    gen.close()
    raise RuntimeError(f"internal: a prompt read yielded {item!r}")
