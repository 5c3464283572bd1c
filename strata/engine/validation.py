"""What the engine checks of a request before it touches anything: the prompt's token ids, its length, max_tokens, n,
logprobs, logit_bias's token ids and the cut points (each refusal a one-line Refused, strata.engine.types)."""
from __future__ import annotations

import numpy as np

from strata.engine.types import ContextOverflow, EmptyPrompt, GenerationRequest, MaxTokensTooLarge
from strata.errors import Refused
from strata.text.token_ids import as_ids, outside_vocab

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for top_logprobs
CUT_KINDS = ("root", "message", "turn", "pin")  # the chat template's cut points (strata.text.chat_template.CutPoint)


def prompt_ids(tokens, n_vocab: int) -> np.ndarray:
    """The request's prompt as int32 token ids (strata.text.token_ids: read in C, no per-token Python work).
    Refused for an id no vocabulary holds."""
    try:
        return as_ids(tokens)
    except ValueError:               # an id past int32: name it as check_request names one past the vocabulary
        bad = outside_vocab([int(t) for t in tokens], n_vocab)
        if bad is None:
            raise
        raise Refused(f"token id {bad} is outside the vocabulary [0, {n_vocab})") from None


def check_request(req: GenerationRequest, prompt: np.ndarray, *, n_ctx: int, n_vocab: int, n_ctx_train: int,
                  remote: bool, prompt_cache: int) -> None:
    """Raise EmptyPrompt, ContextOverflow, MaxTokensTooLarge or another Refused (one line) unless the engine (its
    context, vocabulary, training context, remote stage and checkpoint count) can run `req` over `prompt`."""
    if not prompt.shape[0]:
        raise EmptyPrompt()
    if len(prompt) >= n_ctx:
        raise ContextOverflow(len(prompt), n_ctx)
    bad = outside_vocab(prompt, n_vocab)
    if bad is not None:
        raise Refused(f"token id {bad} is outside the vocabulary [0, {n_vocab})")
    if req.max_tokens is not None and req.max_tokens < 0:
        raise Refused(f"max_tokens must be >= 0, got {req.max_tokens}", param="max_tokens")
    if req.max_tokens is not None and n_ctx_train and req.max_tokens > n_ctx_train:
        raise MaxTokensTooLarge(req.max_tokens, n_ctx_train, n_ctx)   # within it, a full context ends the answer ("length")
    if isinstance(req.n, bool) or not isinstance(req.n, int) or req.n < 1:
        raise Refused(f"n must be an integer >= 1, got {req.n!r}", param="n")
    if req.n > 1 and remote and prompt_cache == 0:
        raise Refused("n > 1 with a remote stage needs --prompt-cache N: the worker keeps the prompt's state "
                      "for the later choices as a checkpoint part", param="n")
    bias = getattr(req.sampling, "logit_bias", ())
    if bias and bias[-1][0] >= n_vocab:          # ids ascending: the last is the largest
        bad = next(t for t, _ in bias if t >= n_vocab)
        raise Refused(f"'logit_bias' names token id {bad}, outside the vocabulary [0, {n_vocab})", param="logit_bias")
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_TOP_LOGPROBS:
        raise Refused(f"logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {req.logprobs}", param="logprobs")
    for c in req.cut_points or ():
        if isinstance(c, dict):
            pos, kind = c.get("pos"), c.get("kind")
        elif hasattr(c, "pos"):
            pos, kind = c.pos, getattr(c, "kind", None)
        else:
            pos, kind = c[0], c[1]
        if kind not in CUT_KINDS:
            raise Refused(f"unknown cut point kind {kind!r} (expected one of {', '.join(CUT_KINDS)})")
        if not 0 <= int(pos) <= len(prompt):
            raise Refused(f"cut point {kind} at {pos} is outside the prompt [0, {len(prompt)}]")
