"""The engine's request and event types: GenerationRequest in, TokenEvent / FinalEvent out, ContextOverflow; the reads
a request's generators ask for (ReadToken, ReadPart) and run_reads, which serves them at once."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Literal

from strata.errors import Refused

FinishReason = Literal["stop", "length", "cancelled"]
ResumeFrom = Literal["live", "checkpoint", "park", "disk", "session", "choice", "none"]


class ContextOverflow(Refused):
    """The prompt does not fit in the context (n_ctx). The message names both numbers."""

    param, code = "messages", "context_length_exceeded"

    def __init__(self, n_prompt: int, n_ctx: int, at_least: bool = False):
        self.n_prompt = int(n_prompt)
        self.n_ctx = int(n_ctx)
        super().__init__(
            f"the prompt has {'at least ' if at_least else ''}{self.n_prompt} tokens but the context holds "
            f"{self.n_ctx} (at most {self.n_ctx - 1} prompt tokens, leaving room for one generated token)")


class MaxTokensTooLarge(Refused):
    """max_tokens asks for more tokens than the model's training context (n_ctx_train) holds."""

    param = "max_tokens"

    def __init__(self, max_tokens: int, n_ctx_train: int, n_ctx: int | None = None):
        self.max_tokens, self.n_ctx_train = int(max_tokens), int(n_ctx_train)
        ctx = (f"; an answer that fills this server's context of {int(n_ctx)} tokens ends with finish_reason "
               f"\"length\"") if n_ctx is not None and int(n_ctx) < self.n_ctx_train else ""
        super().__init__(f"max_tokens is {self.max_tokens}, more than the model's training context of "
                         f"{self.n_ctx_train} tokens (at most {self.n_ctx_train}{ctx})")


class EmptyPrompt(Refused):
    """The prompt has no tokens."""

    def __init__(self) -> None:
        super().__init__("the prompt is empty: at least one token is needed")


@dataclass
class GenerationRequest:
    """One generation on the engine.

    prompt_tokens: token ids (ints in [0, n_vocab)): a list, or an int32 array (strata.text.token_ids: then the engine
    reads it without converting it again); cut_points: the chat template's CutPoint list
    (positions in prompt_tokens where a part may end and a checkpoint may be saved; [] for raw text).
    sampling: a strata.sampling.sampler.SamplingParams (None -> greedy defaults). max_tokens: completion tokens at
    most (None -> until EOG or the context is full). stop: stop strings (matched across tokens, never
    emitted). logprobs: None, or the number of top alternatives (0..20) to report per token.
    cache_prompt=False: do not reuse anything from earlier requests (llama.cpp's meaning).
    checkpoint=False: the one-shot opt-out (no turn_at / periodic checkpoints, no live
    session left; still resumes from a checkpoint and still saves the root). pin_at: a prompt position
    the client asked to keep a checkpoint at (already among cut_points when the template found it).
    ignore_eos: keep generating past end-of-generation tokens (benchmarks; llama.cpp's ignore_eos).
    n: choices to generate from the one prompt read (OpenAI's n): choice i samples with seed + i.
    cancel: set it from another thread to stop between tokens (finish_reason "cancelled").
    deadline: a time.monotonic() past which no more tokens are generated (finish_reason "length"), or None.
    constraint: a strata.sampling.grammar.Constraint the answer must follow (its token mask is applied to the logits before
    sampling; the answer ends when the grammar is complete), or None.
    show_tokens: ids of control tokens whose text is part of the answer (tool-call markers such as <|python_tag|>
    or [TOOL_CALLS], which the parsers of strata.structured.tool_calls read); other control tokens stay invisible.
    spec: False turns speculative decoding off for this request (None: the engine's --spec).
    id_slot: the request slot to run in (llama-server's field; None: the engine picks, strata.engine.slots).
    clock: the request's strata.engine.turn_clock.TurnClock (the engine charges its phases to it), or None.
    """

    prompt_tokens: list[int]
    cut_points: list = field(default_factory=list)
    sampling: Any = None
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None
    cache_prompt: bool = True
    checkpoint: bool = True
    pin_at: int | None = None
    ignore_eos: bool = False
    n: int = 1
    cancel: threading.Event = field(default_factory=threading.Event)
    deadline: float | None = None
    constraint: Any = None
    show_tokens: frozenset[int] = frozenset()
    spec: bool | None = None
    id_slot: int | None = None
    clock: Any = None


@dataclass
class TokenEvent:
    """One generated token. text: the text this token released (may be "" while a possible stop string or
    an incomplete UTF-8 sequence is held back). logprob: natural-log probability of token_id under the
    model's raw logits (None unless requested). top_logprobs: [(token_id, text, logprob)] best first, or None."""

    token_id: int
    text: str
    logprob: float | None = None
    top_logprobs: list[tuple[int, str, float]] | None = None
    index: int = 0                        # the choice it belongs to (GenerationRequest.n)


@dataclass
class FinalEvent:
    """The end of one choice of a generation (the last event of a generation is its last choice's FinalEvent).

    finish_reason: "stop" (EOG token or stop string), "length" (max_tokens or context full),
    "cancelled". text: trailing text held back until the end (an incomplete UTF-8 tail or a partial
    stop-string prefix) that no TokenEvent carried; consumers append it (usually "").
    usage: prompt_tokens, completion_tokens, total_tokens.
    timings (llama.cpp's names): prompt_n (tokens read), prompt_ms, prompt_per_second, predicted_n,
    predicted_ms, predicted_per_second, cache_n (prompt tokens reused); speculative decoding: draft_n (tokens
    drafted), draft_n_accepted (drafts kept), draft_verifies, draft_acceptance_rate, draft_mean_accepted (tokens per
    verify).
    strata: resume_pos, resume_from ("live" | "checkpoint" | "park" | "disk" | "session" | "none"; "choice" for a
    choice after the first: the prompt's state its first choice read), parts [(start, end), ...] read,
    checkpoints (number kept after the request), stop (the stop string or EOG token text that ended it).
    """

    finish_reason: FinishReason
    usage: dict
    timings: dict
    strata: dict
    text: str = ""
    index: int = 0                        # the choice it ends (one FinalEvent per choice)


def spec_timings(drafted: int, accepted: int, verifies: int) -> dict:
    """The speculative-decoding timings of a choice (or a request's choices together)."""
    return {"draft_n": drafted, "draft_n_accepted": accepted, "draft_verifies": verifies,
            "draft_acceptance_rate": accepted / drafted if drafted else 0.0,
            "draft_mean_accepted": (accepted + verifies) / verifies if verifies else 0.0}


def merge_choices(finals: list[FinalEvent]) -> FinalEvent:
    """One FinalEvent for a request from its choices' (in index order): usage over all choices (the prompt counted
    once, OpenAI's n), timings of the prompt read (the first choice's) with the decode summed, the first choice's
    strata; finish_reason and text are the first choice's."""
    first = finals[0]
    if len(finals) == 1:
        return first
    gen = sum(int(f.usage.get("completion_tokens", 0)) for f in finals)
    usage = dict(first.usage, completion_tokens=gen, total_tokens=int(first.usage.get("prompt_tokens", 0)) + gen)
    n_dec = sum(int(f.timings.get("predicted_n", 0)) for f in finals)
    ms = sum(float(f.timings.get("predicted_ms", 0.0)) for f in finals)
    timings = dict(first.timings, predicted_n=n_dec, predicted_ms=ms,
                   predicted_per_second=n_dec / (ms / 1000.0) if ms > 0 else 0.0,
                   **spec_timings(*(sum(int(f.timings.get(k, 0) or 0) for f in finals)
                                    for k in ("draft_n", "draft_n_accepted", "draft_verifies"))))
    return FinalEvent(first.finish_reason, usage, timings, dict(first.strata), first.text, first.index)


@dataclass(frozen=True)
class ReadToken:
    """What a decoding choice asks its driver for: read `token` as the next token of its sequence and send back the
    logits (on the device when on_device and the last stage keeps them there; a batched step sends host rows).
    hidden (a choice with an MTP drafter): send back (logits, the last stage's final-normed row, seconds the
    read took) instead; timed (a choice whose adaptive policy prices plain steps): (logits, that row or None
    without hidden, seconds). pick (a choice whose sampler picks a row's argmax, ``greedy_rows_ok``, without a
    grammar): a Picked may stand in for the logits, the row's greedy pick taken with the other rows' of a batched
    step."""

    token: int
    on_device: bool = False
    hidden: bool = False
    timed: bool = False
    pick: bool = False

    @property
    def triple(self) -> bool:
        """Whether the answer is (logits, final-normed row or None, seconds) rather than the logits alone."""
        return self.hidden or self.timed


@dataclass(frozen=True)
class Picked:
    """A read token's greedy pick sent in place of its logits (ReadToken.pick): the argmax of a row holding no NaN,
    which is what the choice's sampler would pick from it."""

    token_id: int


@dataclass(frozen=True)
class ReadVerify:
    """What a speculating choice asks its driver for: a verify of `tokens` (the sampled token and its drafts) on
    its sequence (Sequence.verify, one forward of len(tokens) tokens keeping each token's state), sending back
    (every row's logits, the last stage's final-normed rows, seconds the verify took). on_device: the rows may stay
    on the last stage's device (a request alone; a step of several slots sends host rows)."""

    tokens: tuple
    on_device: bool = False


@dataclass(frozen=True)
class ReadPart:
    """What a prompt read asks its driver for: read tokens[a:b] (one forward call's worth, at most ubatch) as the
    next tokens of its sequence and send back the last token's logits."""

    tokens: Any
    a: int
    b: int


def run_reads(gen, read):
    """Drive `gen`, a generator that yields ReadToken / ReadVerify / ReadPart requests among its events: each one is
    served at once by read(request) and its result sent back (an exception read raises is thrown into gen at the
    request), every other item is yielded; returns what gen returns. Closing this generator closes gen. What a request
    alone runs on (Engine.generate with one slot); the scheduler serves the same requests in batched steps."""
    value, error = None, None
    try:
        while True:
            try:
                item = gen.throw(error) if error is not None else gen.send(value)
            except StopIteration as stop:
                return stop.value
            value = error = None
            if isinstance(item, (ReadToken, ReadPart, ReadVerify)):
                try:
                    value = read(item)
                except BaseException as e:  # noqa: BLE001 - thrown into gen, whose cleanup decides
                    error = e
                continue
            yield item
    finally:
        gen.close()
