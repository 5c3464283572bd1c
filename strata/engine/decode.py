"""One choice of a generation: sampling token by token from the prompt's last logits (on the device or the host),
or speculatively (a verify of the drafts, judged and committed), the grammar's mask, stop strings,
end-of-generation tokens, max_tokens, a full context and cancels."""
from __future__ import annotations

import time
import dataclasses
import math
import os
from typing import Callable

import numpy as np
import structlog

from strata.engine import turn_clock
from strata.engine.spec_policy import AdaptiveN
from strata.engine.speculate import MAX_DRAFTS, SpecCounts
from strata.engine.types import GenerationRequest, Picked, ReadToken, ReadVerify, TokenEvent, run_reads
from strata.memory.host import hash_log_fields, state_hash_logging
from strata.sampling.sampler import SampleResult, Sampler, SamplingParams, StopMatcher
from strata.sampling.device import DeviceSampler
from strata.sampling.speculative import judge, judge_picks
from strata.stages.sequence import Sequence
from strata.text.tokenizer import StreamDecoder, Tokenizer

log = structlog.get_logger("strata.engine")


def env_flag(name: str) -> bool:
    """Whether the environment variable `name` is set to something other than "", "0", "false" or "no"."""
    return os.environ.get(name, "") not in ("", "0", "false", "no")


class Decoder:
    """Decodes choices on the live sequence `seq` (forward calls of one token, or with `drafter` and ``spec`` > 0 a
    verify of the sampled token and its drafts) with the model's `tokenizer`, its end-of-generation ids `eog_ids`,
    `n_vocab` and the context `n_ctx`; `last_stage` decides where the logits are sampled; `forget_live` is called
    when a forward call fails (the sequence may be half written). spec: drafts per verify (0: off); spec_min_p:
    drafting stops below this draft probability; spec_max_ctx: no drafts once the sequence holds that many tokens
    (0: no limit)."""

    def __init__(self, seq: Sequence, tokenizer: Tokenizer, eog_ids: set[int], n_vocab: int, n_ctx: int, last_stage,
                 forget_live: Callable[[], None], drafter=None, spec: int = 0,
                 spec_min_p: float = 0.0, adaptive: AdaptiveN | None = None, spec_max_ctx: int = 0):
        self.seq, self.tokenizer, self.eog_ids = seq, tokenizer, eog_ids
        self.n_vocab, self.n_ctx, self.last_stage, self.forget_live = n_vocab, n_ctx, last_stage, forget_live
        self.drafter, self.spec, self.spec_min_p = drafter, int(spec), float(spec_min_p)
        self.adaptive = adaptive        # picks the drafts of each verify (0 .. spec) when set
        self.spec_max_ctx = int(spec_max_ctx)   # no drafts once the sequence holds this many tokens (0: no limit)
        self._step: tuple[float, float] | None = None   # a plain step read, its token not yet sampled (_sampled)

    def read(self, r):
        """Serve one read of a choice on the sequence at once (``choice``): a ReadToken's logits (hidden: (logits,
        the final-normed row, the read's seconds)), a ReadVerify's (rows, final-normed rows, seconds)."""
        t0 = time.perf_counter()
        with turn_clock.phase("model"):
            if isinstance(r, ReadVerify):
                rows, h = self.seq.verify(list(r.tokens), on_device=r.on_device)
                return rows, h, time.perf_counter() - t0
            toks = np.asarray([r.token], dtype=np.int32)
            if not r.triple:
                return self.seq.forward(toks, on_device=r.on_device)
            if not r.hidden:
                logits, h = self.seq.forward(toks, on_device=r.on_device), None
            else:
                logits, h = self.seq.forward(toks, on_device=r.on_device, hidden=True)
            return logits, h, time.perf_counter() - t0

    def _sampled(self) -> None:
        """A plain step's token sampled: its time (the read and the sampling, which waits for a device's read;
        not the drafter's feed between them) to the adaptive policy."""
        if self._step is not None:
            read_s, t = self._step
            self._step = None
            self.adaptive.plain_step(read_s + time.perf_counter() - t)

    def choice(self, req: GenerationRequest, prompt: np.ndarray, logits, params: SamplingParams, index: int,
               counts: SpecCounts | None = None, record: list | None = None):
        """``steps`` with every token read at once on the sequence (a request alone): yields TokenEvents, returns
        what ``steps`` returns."""
        return run_reads(self.steps(req, prompt, logits, params, index, counts, record), self.read)

    def steps(self, req: GenerationRequest, prompt: np.ndarray, logits, params: SamplingParams, index: int,
              counts: SpecCounts | None = None, record: list | None = None):
        """Generate one choice from the sequence as it stands (the prompt read) and the prompt's last logits: yields
        TokenEvents and, for each token it reads, a ReadToken whose logits its driver sends back (``choice``, or the
        scheduler's batched step; with a drafter, its hidden row and seconds too), for each verify a ReadVerify
        (``choice``, or the scheduler's step); returns (finish_reason, token ids, trailing text, stopped_by). Choice
        `index` samples with seed + index (a fresh draw when the seed is unset). counts: what speculative decoding
        did, added up here. record: a list each TokenEvent is appended to as it is yielded (greedy choices' replay).

        With drafts (``spec`` > 0, the request's ``spec`` not False; under a grammar, the drafts it allows): each
        sampled token is read together with up to ``spec`` drafts in one verify; ``judge`` keeps a prefix of the
        drafts and samples the token after it; the tokens are emitted one by one with the same checks as without
        drafts, and the sequence is committed at the position decoding them one at a time would have reached (the
        last token emitted is sampled, not read)."""
        self._step = None
        if index and params.seed is not None and params.seed != -1:
            params = dataclasses.replace(params, seed=(params.seed + index) % 2 ** 64)
        n = len(prompt)
        want_lp = params.logprobs is not None
        # a last stage on a GPU keeps the logits on the device and samples there; STRATA_DEVICE_SAMPLING=0 turns that
        # off (host copy + Sampler)
        on_device = self.last_stage.device_logits and os.environ.get("STRATA_DEVICE_SAMPLING", "1") not in (
            "0", "false", "no")
        sampler = (DeviceSampler if on_device else Sampler)(params, self.n_vocab)
        k = params.repeat_last_n        # tokens of history the penalties see (0 none, -1 all)
        for t in (prompt[-k:] if k > 0 else prompt if k == -1 else prompt[:0]).tolist():
            sampler.accept(t)            # the penalties see the prompt too (as llama.cpp's server does)
        decoder = StreamDecoder(self.tokenizer, show=req.show_tokens)
        # strata.sampling.grammar: the token mask, computed during the forward on the CPU backend and inline when the
        # logits stay on a GPU (docs/serving.md)
        guide = req.constraint.start(overlap=not on_device, banned=[t for t, b in params.logit_bias if b == -math.inf]) \
            if req.constraint is not None else None
        # drafting: under a grammar too (each verified row masked by the grammar's state after the drafts before
        # it; the rejected drafts rolled back)
        spec = self.spec if (self.drafter is not None and req.spec is not False) else 0
        # a greedy verify without a grammar, penalties, logprobs or logit_bias is judged on the device: each row's greedy pick
        # taken there, only the picks copied to the host (every row's logits otherwise)
        picks_on_device = on_device and guide is None and sampler.greedy_rows_ok
        counts = counts if counts is not None else SpecCounts()
        stopper = StopMatcher(list(req.stop or []))
        max_new = req.max_tokens if req.max_tokens is not None else self.n_ctx
        st = self.seq
        finish = None
        stopped_by: str | None = None
        toks: list[int] = []
        trailing = ""

        def emit(res):
            """Take one sampled token -> (its TokenEvent or None, why the choice ends or None)."""
            nonlocal stopped_by
            tok = int(res.token_id)
            toks.append(tok)
            if tok in self.eog_ids and not req.ignore_eos:
                stopped_by = self.tokenizer.decode([tok], special=True)
                return None, "stop"
            lp = top = None
            if want_lp:
                lp = res.logprob
                top = [(i, self.tokenizer.decode([i], special=True), v) for i, v in (res.top_logprobs or [])]
            text, hit = stopper.feed(decoder.feed(tok))
            ev = TokenEvent(tok, text, lp, top, index=index)
            if hit:
                stopped_by = stopper.matched
                return ev, "stop"
            if len(toks) >= max_new or n + len(toks) >= self.n_ctx or (
                    req.deadline is not None and time.monotonic() >= req.deadline):
                return ev, "length"       # max_tokens, the context is full (total tokens = n_ctx), or the time
            if req.cancel.is_set():
                return ev, "cancelled"
            return ev, None

        try:
            while True:
                if logits is None:            # cancelled while reading the prompt
                    finish = "cancelled"
                    break
                if len(toks) >= max_new:
                    finish = "length"
                    break
                if req.cancel.is_set():
                    finish = "cancelled"
                    break
                with turn_clock.phase("sample"):
                    if isinstance(logits, Picked):     # a batched step's greedy pick (ReadToken.pick)
                        res = SampleResult(logits.token_id, float("nan"), None)
                    else:
                        if guide is not None:
                            logits = guide.apply(logits)
                        res = sampler.sample(logits)
                    tok = int(res.token_id)
                if self.adaptive is not None:
                    self._sampled()
                sampler.accept(tok)
                if guide is not None:
                    guide.accept(tok)
                ev, finish = emit(res)
                if ev is not None:
                    if record is not None:
                        record.append(ev)
                    yield ev
                # read the token sampled: with drafts, a verify, whose last token is sampled in turn
                while finish is None and spec:
                    base = st.pos
                    # drafts that could be emitted: max_tokens and the context bound them (and a short read's rows)
                    want = self.adaptive.choose() if self.adaptive is not None else spec
                    room = min(want, max_new - len(toks) - 1, self.n_ctx - n - len(toks) - 1, MAX_DRAFTS)
                    if self.spec_max_ctx and base >= self.spec_max_ctx:
                        room = 0                  # past --spec-max-ctx: plain decode steps
                    if room > 0 and self.adaptive is not None:
                        self.drafter.flush()      # the rows held, fed whatever is chosen: not timed as drafting
                    t0 = time.perf_counter()
                    drafts = self.drafter.draft(tok, room, self.spec_min_p) if room > 0 else []
                    masks = None
                    if guide is not None and drafts:     # drafts the grammar allows, each consumed in turn
                        masks = guide.draft_masks([d.token for d in drafts])
                        drafts = drafts[:len(masks) - 1]
                    if not drafts:
                        break
                    t1 = time.perf_counter()
                    rows, h, verify_s = yield ReadVerify((tok, *(d.token for d in drafts)), picks_on_device)
                    t_in = time.perf_counter()
                    picks = sampler.greedy_rows(rows) if picks_on_device else None    # waits for the device
                    t2 = time.perf_counter()
                    verify_s += t2 - t_in
                    if masks is not None:
                        rows = [guide.apply_mask(rows[i], masks[i]) for i in range(len(masks))]
                    if picks is not None:
                        verdict = judge_picks(sampler, picks, drafts)
                    else:
                        verdict = judge(sampler, rows, drafts)
                    if guide is not None:                # the state after the kept drafts and the token after them
                        guide.rollback(len(drafts) - verdict.accepted)
                        guide.accept(int(verdict.tokens[-1].token_id))
                    t3 = time.perf_counter()
                    counts.verifies += 1
                    counts.drafted += len(drafts)
                    counts.accepted += verdict.accepted
                    # the position decoding one at a time reaches: t and the tokens emitted before the last are
                    # read; a cancel seen between two tokens comes after the last emitted one was read
                    j = 0
                    try:
                        for r in verdict.tokens:
                            if req.cancel.is_set():
                                finish = "cancelled"
                                j += 1
                                break
                            j += 1
                            ev, finish = emit(r)
                            if ev is not None:
                                if record is not None:
                                    record.append(ev)
                                yield ev
                            if finish is not None:
                                break
                    finally:             # the consumer may close the choice at a yield: the Commit lands anyway
                        t4 = time.perf_counter()
                        st.commit(base + max(j, 1))
                        t5 = time.perf_counter()
                    self.drafter.observe(base, h[:j])
                    if self.adaptive is not None:       # the round besides drafting and the verify: judge, Commit
                        self.adaptive.verified(len(drafts), verdict.accepted, t1 - t0, verify_s,
                                               (t3 - t2) + (t5 - t4) + (time.perf_counter() - t5))
                    tok = int(verdict.tokens[j - 1].token_id)
                if finish is not None:
                    break
                pick = guide is None and sampler.greedy_rows_ok      # the row's argmax is the token
                if self.drafter is None or not (self.drafter.wants_hidden or self.adaptive is not None):
                    logits = yield ReadToken(tok, on_device, pick=pick)
                else:                         # an MTP drafter sees every row's hidden state
                    pos = st.pos
                    logits, h, read_s = yield ReadToken(tok, on_device, hidden=self.drafter.wants_hidden,
                                                        timed=self.adaptive is not None, pick=pick)
                    if h is not None:
                        self.drafter.observe(pos, h)
                    if self.adaptive is not None:     # the step's time ends once its token is sampled (_sampled)
                        self._step = (read_s, time.perf_counter())
            if not stopper.stopped:         # a stop string's tail and what follows it are dropped
                # a character the last token left incomplete (max_tokens, cancel) is dropped, never sent as U+FFFD
                tail, _ = stopper.feed(decoder.flush(drop_incomplete=True))
                trailing = tail + stopper.flush()
                if stopper.stopped and finish != "cancelled":   # the held-back text held a stop string
                    finish, stopped_by = "stop", stopper.matched
        except GeneratorExit:         # the consumer closed the iterator (client went away): a cancel
            raise
        except BaseException:
            # an error inside a forward call may leave a layer's K/V half written: start over next time
            self.forget_live()
            raise
        finally:
            if guide is not None:
                guide.close()
            if self.drafter is not None and finish is not None:
                self.drafter.flush()     # parked or saved between requests: the drafter's K/V goes along
            if state_hash_logging():
                h = st.hashes()
                log.info("state_hash", pos=st.pos, tokens=h["tokens"], **hash_log_fields(h))
                st.hash_point()          # a remote stage's workers log their layers' hashes here
        return finish, toks, trailing, stopped_by
