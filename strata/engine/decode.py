"""One choice of a generation: sampling token by token from the prompt's last logits (on the device or the host),
the grammar's mask, stop strings, end-of-generation tokens, max_tokens, a full context and cancels."""
from __future__ import annotations

import time
import dataclasses
import os
from typing import Callable

import numpy as np
import structlog

from strata.engine.types import GenerationRequest, TokenEvent
from strata.sampling.sampler import Sampler, SamplingParams, StopMatcher
from strata.sampling.device import DeviceSampler
from strata.stages.sequence import Sequence
from strata.text.tokenizer import StreamDecoder, Tokenizer

log = structlog.get_logger("strata.engine")


def env_flag(name: str) -> bool:
    """Whether the environment variable `name` is set to something other than "", "0", "false" or "no"."""
    return os.environ.get(name, "") not in ("", "0", "false", "no")


class Decoder:
    """Decodes choices on the live sequence `seq` (forward calls of one token) with the model's `tokenizer`,
    its end-of-generation ids `eog_ids`, `n_vocab` and the context `n_ctx`; `last_stage` decides where the logits are
    sampled; `forget_live` is called when a forward call fails (the sequence may be half written)."""

    def __init__(self, seq: Sequence, tokenizer: Tokenizer, eog_ids: set[int], n_vocab: int, n_ctx: int, last_stage,
                 forget_live: Callable[[], None]):
        self.seq, self.tokenizer, self.eog_ids = seq, tokenizer, eog_ids
        self.n_vocab, self.n_ctx, self.last_stage, self.forget_live = n_vocab, n_ctx, last_stage, forget_live

    def choice(self, req: GenerationRequest, prompt: np.ndarray, logits, params: SamplingParams, index: int):
        """Generate one choice from the sequence as it stands (the prompt read) and the prompt's last logits: yields
        TokenEvents, returns (finish_reason, token ids, trailing text, stopped_by). Choice `index` samples with
        seed + index (a fresh draw when the seed is unset)."""
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
        guide = req.constraint.start(overlap=not on_device) if req.constraint is not None else None
        stopper = StopMatcher(list(req.stop or []))
        max_new = req.max_tokens if req.max_tokens is not None else self.n_ctx
        st = self.seq
        finish = None
        stopped_by: str | None = None
        toks: list[int] = []
        trailing = ""
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
                if guide is not None:
                    logits = guide.apply(logits)
                res = sampler.sample(logits)
                tok = int(res.token_id)
                sampler.accept(tok)
                if guide is not None:
                    guide.accept(tok)
                toks.append(tok)
                if tok in self.eog_ids and not req.ignore_eos:
                    finish = "stop"
                    stopped_by = self.tokenizer.decode([tok], special=True)
                    break
                lp = top = None
                if want_lp:
                    lp = res.logprob
                    top = [(i, self.tokenizer.decode([i], special=True), v) for i, v in (res.top_logprobs or [])]
                text, hit = stopper.feed(decoder.feed(tok))
                yield TokenEvent(tok, text, lp, top, index=index)
                if hit:
                    finish = "stop"
                    stopped_by = stopper.matched
                    break
                if len(toks) >= max_new or n + len(toks) >= self.n_ctx or (
                        req.deadline is not None and time.monotonic() >= req.deadline):
                    finish = "length"      # max_tokens, the context is full (total tokens = n_ctx), or the time
                    break
                if req.cancel.is_set():
                    finish = "cancelled"
                    break
                logits = st.forward(np.asarray([tok], dtype=np.int32), on_device=on_device)
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
            if env_flag("STRATA_STATE_HASH"):
                h = st.hashes()
                log.info("state_hash", pos=st.pos, **{k: v for k, v in h.items() if ".L" not in k})
        return finish, toks, trailing, stopped_by
