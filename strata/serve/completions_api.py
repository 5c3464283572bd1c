"""OpenAI's /v1/chat/completions and /v1/completions: a request rendered (chat), constrained, validated, queued on
the engine worker and answered as JSON or SSE; generate_chat is also the path of the Responses and Messages routes."""
from __future__ import annotations

import json
import threading
import time
from typing import Any

import structlog
from aiohttp import web

from strata import __version__
from strata.engine import turn_clock
from strata.engine.types import ContextOverflow, EmptyPrompt, FinalEvent, merge_choices
from strata.errors import Refused
from strata.serve import prepare, schema
from strata.serve.config import CONFIG_KEY, WORKER_KEY
from strata.serve.errors import ApiError, refusal
from strata.serve.handling import (as_api_error, json_response, n_ctx_train, next_event, read_body,
                                   serving_engine, submit)
from strata.serve.logprobs import LogprobsAcc
from strata.serve.worker import EngineError
from strata.structured import plan as structured
from strata.text.token_ids import outside_vocab

log = structlog.get_logger("strata.serve")


def _sampling(p: schema.ParsedRequest):
    from strata.sampling.sampler import SamplingParams
    try:
        return SamplingParams(**p.sampling)
    except (ValueError, TypeError) as e:
        raise ApiError(400, f"bad sampling parameters: {e}", code="invalid_value") from None


async def chat_completions(request: web.Request) -> web.StreamResponse:
    p = await read_body(request, schema.parse_chat)
    _parsed(request)
    return await generate_chat(request, p)


def _parsed(request: web.Request) -> None:
    """The body read and parsed: the request's parse phase (TurnClock; from its arrival, the middleware's
    work included)."""
    clock = request.get("clock")
    if clock is not None:
        clock.add("parse", time.perf_counter() - clock.arrival)


async def render_chat(request: web.Request, p: schema.ParsedRequest):
    """A parsed chat request on the serving engine, rendered by its template: (engine, plan, rendered). The model is
    checked first; a refusal of the template or a prompt too long to render is an ApiError naming 'messages'."""
    engine = serving_engine(request)

    def render(plan):
        try:
            with turn_clock.active(request.get("clock")), turn_clock.phase("render"):
                r = engine.render_chat(plan.messages, tools=plan.tools, pin_message=plan.pin,
                                       **({"add_generation_prompt": False, "continue_final_message": True}
                                          if p.continue_final else {}), **plan.template_kwargs)
                turn_clock.charge("tokenize", r.tokenize_s)      # out of the render's time
        except ContextOverflow as e:     # too long to be worth rendering and tokenizing
            raise ApiError(400, str(e), param="messages", code="context_length_exceeded") from None
        except ValueError as e:
            raise ApiError(400, f"the chat template refused the messages: {e}",
                           param=getattr(e, "param", None) or "messages", code="invalid_value") from None
        structured.after_render(plan, r.text)
        return plan, r

    def plan_and_render():
        return render(structured.plan_chat(engine, p))   # tools, reasoning, response_format (strata.structured.plan)
    if prepare.is_heavy(request):        # a large request: planned and rendered in the preparation pool
        return engine, *await prepare.prepared(request, plan_and_render)
    # a later turn of a chat rendered before takes about a millisecond: rendered here, where two thread hops would
    # cost as much or more on a busy machine; anything else in the preparation pool
    plan = structured.plan_chat(engine, p)
    quick = getattr(engine, "renders_quickly", None)
    return engine, *await prepare.prepared(request, lambda: render(plan),
                                           heavy=quick is None or not quick(plan.messages))


async def _constraint(request: web.Request, compile_it):
    """The grammar compiled in the preparation pool; a schema it refuses is a 400 naming its field."""
    try:
        return await prepare.prepared(request, compile_it, heavy=True)
    except Refused as e:
        raise refusal(e) from None


async def generate_chat(request: web.Request, p: schema.ParsedRequest, respond=None) -> web.StreamResponse:
    """Answer a parsed chat request: rendered (render_chat), constrained, generated. respond(request, engine, p, job,
    answers) sends the answer (default: the chat completion's JSON or SSE); the Responses and Messages routes pass
    their own."""
    engine, plan, rendered = await render_chat(request, p)
    # a grammar is compiled off the event loop; without one no thread hop (each costs a wake-up)
    constraint = None if plan.body is None and plan.gbnf is None else await _constraint(
        request, lambda: structured.chat_constraint(engine, plan, structured.param_of(p)))
    return await _generate(request, engine, p, rendered.ids, list(rendered.cut_points), plan=plan,
                           constraint=constraint, respond=respond)


async def completions(request: web.Request) -> web.StreamResponse:
    p = await read_body(request, schema.parse_completion)
    _parsed(request)
    return await generate_completion(request, p)


async def generate_completion(request: web.Request, p: schema.ParsedRequest, respond=None) -> web.StreamResponse:
    """Answer a parsed raw completion: the prompt tokenized (or its token ids checked), constrained, generated;
    respond as for generate_chat (answers: [None], the events carry the text)."""
    engine = serving_engine(request)
    if isinstance(p.prompt, str):
        text = p.prompt

        def tokenize():
            with turn_clock.active(request.get("clock")), turn_clock.phase("tokenize"):
                return engine.tokenize_prompt(text)
        try:
            tokens = await prepare.prepared(request, tokenize, heavy=True)
        except ContextOverflow as e:
            raise ApiError(400, str(e), param="prompt", code="context_length_exceeded") from None
        except ValueError as e:          # e.g. a lone surrogate: no UTF-8 encoding, so no tokens
            raise ApiError(400, f"'prompt': {e}", param="prompt", code="invalid_value") from None
    else:
        tokens = p.prompt
        n_vocab = getattr(engine, "n_vocab", None)
        bad = outside_vocab(tokens, n_vocab)
        if bad is not None:
            raise ApiError(400, f"'prompt' holds token id {bad} outside the vocabulary [0, {n_vocab})",
                           param="prompt", code="invalid_value")
    constraint = None if p.output is None else await _constraint(
        request, lambda: structured.completion_constraint(engine, p))
    return await _generate(request, engine, p, tokens, [], constraint=constraint, respond=respond)


async def _generate(request: web.Request, engine, p: schema.ParsedRequest, tokens,
                    cut_points: list, plan: structured.ChatPlan | None = None,
                    constraint=None, respond=None) -> web.StreamResponse:
    from strata.engine.types import GenerationRequest
    from strata.text.token_ids import as_ids          # one conversion: validate and generate read it as it is

    cfg = request.app[CONFIG_KEY]
    max_tokens = p.max_tokens
    if max_tokens is None:                # the server's default length (--n-predict; -1: until the context is full)
        n_predict = cfg.n_predict
        n_train = n_ctx_train(engine)
        max_tokens = None if n_predict < 0 else min(n_predict, n_train) if n_train else n_predict
    try:
        greq = GenerationRequest(prompt_tokens=as_ids(tokens), cut_points=cut_points, sampling=_sampling(p),
                                 max_tokens=max_tokens, stop=p.stop,
                                 logprobs=p.top_logprobs if p.logprobs else None,
                                 cache_prompt=p.cache_prompt, checkpoint=p.checkpoint, n=p.n, spec=p.spec,
                                 id_slot=p.id_slot,
                                 cancel=threading.Event(),
                                 deadline=time.monotonic() + cfg.max_request_seconds if cfg.max_request_seconds
                                 else None,
                                 constraint=constraint, show_tokens=plan.show_tokens if plan else frozenset(),
                                 clock=request.get("clock"))
        engine.validate(greq)              # refused now rather than after the queue (max_tokens past n_ctx_train, ...)
    except ValueError as e:
        err = as_api_error(EngineError(e))
        if isinstance(e, ContextOverflow):
            err.param = "messages" if p.kind == "chat" else "prompt"
        elif isinstance(e, EmptyPrompt):
            err.param = "prompt"
        raise err from None
    asked = p.n * (max_tokens if max_tokens is not None else engine.n_ctx)
    cap = max(cfg.max_request_tokens, engine.n_ctx)      # one choice may always fill the context
    if asked > cap:
        raise ApiError(400, f"the request asks for up to {asked} tokens (n = {p.n} choices of "
                            f"{max_tokens if max_tokens is not None else f'up to n_ctx = {engine.n_ctx}'}), more "
                            f"than --max-request-tokens ({cap}): ask for fewer choices or "
                            f"tokens", param="max_tokens" if max_tokens is not None else "n",
                       code="invalid_value")
    w = request.app[WORKER_KEY]
    job = submit(w, greq, rid=request["rid"])
    log.debug("queued", prompt_tokens=len(tokens), waiting=w.waiting, stream=p.stream)
    done = False
    try:
        answers = [plan.answer() if plan is not None else None for _ in range(p.n)]   # one parser per choice
        respond = respond or (_stream if p.stream else _collect)
        resp = await respond(request, engine, p, job, answers)
        done = True
        return resp
    finally:
        if not done:
            w.drop(job)  # client gone (task cancelled / write failed) or error: stop within one token


def _ids(request, p) -> tuple[str, int]:
    prefix = "chatcmpl-" if p.kind == "chat" else "cmpl-"
    return prefix + request["rid"], int(time.time())


def usage_of(final) -> dict:
    u = dict(final.usage)
    u["prompt_tokens_details"] = {"cached_tokens": int(final.timings.get("cache_n", 0) or 0)}
    return u


def timings_of(final) -> dict:
    t = dict(final.timings)
    for k in ("prompt_ms", "predicted_ms", "prompt_per_second", "predicted_per_second"):
        if k in t and t[k] is not None:
            t[k] = round(float(t[k]), 3)
    return t


def strata_of(final, request: web.Request | None = None) -> dict:
    """The response's strata block: the FinalEvent's, and `turn` (the request's TurnClock report: where the time to
    its first token went) once its first token has left."""
    s = dict(final.strata or {})
    if "parts" in s:
        s["parts"] = [list(x) for x in s["parts"]]
    clock = request.get("clock") if request is not None else None
    turn = clock.report() if clock is not None else None
    if turn is not None:
        s["turn"] = turn
    return s


async def _collect(request, engine, p, job, answers: list | None = None) -> web.Response:
    answers = answers or [None] * p.n
    pieces: list[list[str]] = [[] for _ in range(p.n)]
    accs = [LogprobsAcc(engine, p.kind) for _ in range(p.n)]
    finals = []
    while len(finals) < p.n:
        ev = await next_event(job)
        if isinstance(ev, FinalEvent):
            _first_token(request)             # a choice that ended before any token: its end is what leaves
            finals.append(ev)
            pieces[ev.index].append(ev.text or "")
            accs[ev.index].finish(ev.text or "")
            continue
        pieces[ev.index].append(ev.text)
        accs[ev.index].add(ev, ev.text)
        _first_token(request)
    cid, created = _ids(request, p)
    choices = []
    for f in finals:
        text = "".join(pieces[f.index])
        lp = accs[f.index].result() if p.logprobs else None
        if p.kind == "chat":
            message, finish, answer = {"role": "assistant", "content": text}, f.finish_reason, answers[f.index]
            if answer is not None:
                answer.feed(text)
                answer.finish(answer.cut_by(f))
                message, finish = answer.message(), answer.finish_reason(finish)
            choices.append({"index": f.index, "message": message, "logprobs": lp, "finish_reason": finish})
        else:
            choices.append({"index": f.index, "text": text, "logprobs": lp, "finish_reason": f.finish_reason})
    final = merge_choices(finals)
    return json_response({"id": cid, "object": "chat.completion" if p.kind == "chat" else "text_completion",
                          "created": created, "model": engine.model_name, "system_fingerprint": f"strata-{__version__}",
                          "choices": choices, "usage": usage_of(final), "timings": timings_of(final),
                          "strata": strata_of(final, request)})


def _first_token(request: web.Request) -> None:
    """A token event handled (streamed: its text written to the socket), or a choice's end when no token came
    before it: the request's TurnClock stops at the first."""
    clock = request.get("clock")
    if clock is not None and not clock.done:
        clock.first_token()


async def _stream(request, engine, p, job, answers: list | None = None) -> web.StreamResponse:
    """SSE chunks, each choice's (its `index`) in turn; the last choice's finish chunk carries the request's timings
    and strata, the usage chunk (include_usage) sums the choices. A chat answer with a parser (tools, reasoning) is
    taken apart into content / reasoning_content / tool_calls deltas."""
    answers = answers or [None] * p.n
    cid, created = _ids(request, p)
    chat = p.kind == "chat"
    base = {"id": cid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": engine.model_name, "system_fingerprint": f"strata-{__version__}"}
    accs = [LogprobsAcc(engine, p.kind) for _ in range(p.n)]
    finals = []
    started: set[int] = set()
    resp: web.StreamResponse | None = None

    def chunk(choices: list, **extra) -> bytes:
        d = dict(base, choices=choices, **extra)
        if p.include_usage and "usage" not in d:
            d["usage"] = None
        return b"data: " + json.dumps(d, ensure_ascii=False).encode() + b"\n\n"

    def choice(i: int, text: str | None, lp, finish=None, role=False) -> dict:
        if chat:
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            return {"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}
        return {"index": i, "text": text or "", "logprobs": lp, "finish_reason": finish}

    async def pieces(i: int, text: str, lp, end: bool = False, cut: bool = False) -> None:
        """One event's text of choice i as chunks: a chat answer taken apart (content / reasoning_content /
        tool_calls deltas, the logprobs on the first), else as text."""
        answer = answers[i]
        if answer is None:
            if text or lp is not None:
                await resp.write(chunk([choice(i, text, lp)]))
            return
        deltas = answer.feed(text) + (answer.finish(cut) if end else [])
        if not deltas and lp is not None:
            deltas = [{"content": ""}]
        for k, d in enumerate(deltas):
            await resp.write(chunk([{"index": i, "delta": d, "logprobs": lp if k == 0 else None,
                                     "finish_reason": None}]))

    try:
        while True:
            try:
                ev = await next_event(job)
            except ApiError as e:
                if resp is None:
                    raise
                await resp.write(b"data: " + json.dumps(e.body()).encode() + b"\n\n")
                await resp.write(b"data: [DONE]\n\n")
                return resp
            if resp is None:
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                                   "Cache-Control": "no-cache", "X-Request-Id": request["rid"],
                                                   "X-Accel-Buffering": "no"})
                await resp.prepare(request)
            i = ev.index
            if chat and i not in started:
                started.add(i)
                await resp.write(chunk([choice(i, "", None, role=True)]))
            if isinstance(ev, FinalEvent):
                finals.append(ev)
                tail = ev.text or ""
                lp = accs[i].finish(tail) if p.logprobs else None
                await pieces(i, tail, lp, end=True, cut=answers[i] is not None and answers[i].cut_by(ev))
                finish = answers[i].finish_reason(ev.finish_reason) if answers[i] is not None else ev.finish_reason
                _first_token(request)         # a choice that ended before any token: its end is what leaves
                if len(finals) < p.n:
                    await resp.write(chunk([choice(i, None if chat else "", None, finish)]))
                    continue
                final = merge_choices(finals)
                await resp.write(chunk([choice(i, None if chat else "", None, finish)],
                                       timings=timings_of(final), strata=strata_of(final, request)))
                if p.include_usage:
                    await resp.write(chunk([], usage=usage_of(final)))
                await resp.write(b"data: [DONE]\n\n")
                await resp.write_eof()
                return resp
            lp = accs[i].add(ev, ev.text) if p.logprobs else None
            await pieces(i, ev.text, lp)
            _first_token(request)
    except (ConnectionResetError, ConnectionError) as e:
        log.info("client disconnected mid-stream", error=str(e) or type(e).__name__)
        request.app[WORKER_KEY].drop(job)
        return resp if resp is not None else web.Response(status=499)
