"""Reading a request's prompt into the live sequence: the checkpoint cache's plan (after a parked conversation may
have been switched in), its snapshot restored or the sequence cut back or continued, the parts read in ubatch-sized
forward calls, checkpoints saved where the plan says."""
from __future__ import annotations

import time

import numpy as np
import structlog

from strata.cache.checkpoints import CheckpointCache
from strata.engine.parking import Conversations
from strata.engine.types import GenerationRequest
from strata.stages.remote import CheckpointGone
from strata.stages.sequence import Sequence
from strata.text.token_ids import is_prefix

log = structlog.get_logger("strata.engine")


class PromptReader:
    """Reads prompts into `seq` (the engine's live sequence) with its checkpoint cache `cache`, switching parked
    `conversations` in first, `ubatch` tokens per forward call. The engine calls it under its lock."""

    def __init__(self, seq: Sequence, cache: CheckpointCache, conversations: Conversations, ubatch: int,
                 drafter=None):
        self.seq, self.cache, self.conversations, self.ubatch = seq, cache, conversations, ubatch
        self.drafter = drafter      # an MTPDrafter sees the hidden states of every prompt token read (or None)

    def forget_live(self) -> None:
        """The live sequence back to position 0, and the checkpoint cache told not to continue it: the next request
        starts from a checkpoint or from 0."""
        self.seq.reset()
        self.cache.drop_live()

    def read(self, tokens: np.ndarray, start: int, end: int, cancel=None):
        """Read tokens[start:end] in ubatch-sized forward calls starting fresh at `start` -> the last token's
        logits, or None when `cancel` was set between two calls (the sequence then ends at a call boundary)."""
        logits = None
        p = start
        while p < end:
            if cancel is not None and cancel.is_set():
                return None
            q = min(end, p + self.ubatch)
            if self.drafter is None:
                logits = self.seq.forward(tokens[p:q])
            else:
                logits, h = self.seq.forward(tokens[p:q], hidden=True)
                self.drafter.observe(p, h)
            p = q
        if self.drafter is not None:
            self.drafter.flush()          # a checkpoint at the part's end carries the drafter's K/V
        return logits

    def apply(self, req: GenerationRequest, prompt: np.ndarray):
        """Plan the read (CheckpointCache.plan, pure), then the one step that puts the live sequence at the plan's
        resume point: its checkpoint restored, or the sequence cut back or reset, and settled (a remote stage's
        Commits landed); the cache then told (begin). A checkpoint gone from a worker: the cache cleared and the
        prompt planned again, from 0. -> the plan applied."""
        def plan():
            return self.cache.plan(self.seq, prompt, list(req.cut_points or ()), checkpoint=req.checkpoint,
                                   cache_prompt=req.cache_prompt)      # cut points were checked by check_request
        p, st = plan(), self.seq
        if p.snapshot is not None:
            try:
                st.restore(p.snapshot)
            except CheckpointGone as e:      # the worker restarted or reconnected: read from token 0
                log.warning("a checkpoint is gone from the worker: reading from 0", error=str(e))
                self.forget_live()
                self.cache.clear()
                p = plan()
        if p.snapshot is None:
            if p.resume_from == "none" or p.resume_pos == 0:
                st.reset()
            elif p.resume_pos < st.pos:
                st.truncate(p.resume_pos)
        st.settle()                # the worker's Commits land before the prompt is read
        self.cache.begin(p)
        return p

    def prefill(self, req: GenerationRequest, prompt: np.ndarray, trace: bool):
        """Plan, restore / cut back / continue, read the parts, save checkpoints -> (plan, parts, logits).

        logits is None when req.cancel was set during the read: the sequence then ends at a forward-call
        boundary inside a part, so it is not offered for live continuation (a later read of that part must
        split it the same way as the first); checkpoints of the parts completed stay."""
        n = len(prompt)
        if self.seq.lost():        # a remote stage reconnected: the worker holds none of it any more
            log.warning("a remote stage lost the live sequence and its checkpoints: reading from 0")
            self.forget_live()
            self.cache.clear()
        convs = self.conversations
        try:
            unparked = convs.switch(prompt, req.cache_prompt, trace)  # "resident" | "park" | "disk" | None
        except BaseException:
            self.forget_live()     # a restore that failed part-way: the live sequence starts over
            raise
        parts: list[tuple[int, int]] = []
        try:
            st = self.seq
            plan = self.apply(req, prompt)
            if plan.resume_pos > 0 and (unparked or convs.from_session):
                plan.resume_from = unparked or "session"
            convs.from_session = False
            resume = plan.resume_pos
            if st.pos != resume or not 0 <= resume < n or not is_prefix(st.ids, prompt):
                raise RuntimeError(f"internal: plan resumes at {resume} ({plan.resume_from}) but the sequence "
                                   f"holds {st.pos} tokens that are not that prefix of the {n}-token prompt")
            if trace:
                log.info("prefill_plan", plan=plan.describe(), checkpoints=len(self.cache))
            logits = None
            start = resume
            ends = [e for e in plan.part_ends if resume < e <= n]
            if not ends or ends[-1] != n:
                ends.append(n)
            for end in ends:
                t0 = time.perf_counter()
                logits = self.read(prompt, start, end, req.cancel)
                if logits is None:
                    self.cache.drop_live()
                    if trace:
                        log.info("prefill_cancelled", start=start, end=end, pos=st.pos)
                    break
                parts.append((start, end))
                kind = plan.save_at.get(end)
                if kind is not None:
                    self.cache.save(end, kind, st.capture())
                if trace:
                    log.info("prefill_part", start=start, end=end, n_tokens=end - start, ubatch=self.ubatch,
                             ms=round((time.perf_counter() - t0) * 1000.0, 2), checkpoint=kind)
                start = end
        except BaseException:
            # a failed or interrupted read leaves the arena partly written: start the next request from 0
            self.forget_live()
            raise
        return plan, parts, logits
