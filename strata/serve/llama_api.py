"""llama-server's own routes with its request and response shapes: /completion (its fields, its JSON and SSE
shapes, on the completion route's path), /tokenize, /detokenize, /apply-template, /props.

Shapes follow llama.cpp's tools/server/README.md. Errors on these routes are llama-server's error objects,
{"error": {"code", "message", "type"}} (types invalid_request_error, not_found_error, server_error,
not_supported_error, unavailable_error, exceed_context_size_error), not OpenAI's.
"""
from __future__ import annotations

import functools
import json
import math
import re

from aiohttp import web

from strata import __version__
from strata.engine.types import FinalEvent
from strata.serve import schema
from strata.serve.completions_api import generate_completion
from strata.serve.config import CONFIG_KEY, ERROR_SHAPES_KEY, WORKER_KEY
from strata.serve.errors import ApiError, renamed
from strata.serve.handling import engine_call, engine_of, json_response, next_event, read_body, whole_context
from strata.serve.prepare import prepared
from strata.structured import plan as structured
from strata.text.token_ids import outside_vocab

# HTTP status -> llama-server's error type (tools/server: format_error_response)
LLAMA_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                     404: "not_found_error", 500: "server_error", 501: "not_supported_error",
                     503: "unavailable_error"}


def llama_error(e: ApiError) -> dict:
    """An ApiError in llama-server's shape (the error shape make_app registers for these routes)."""
    kind = "exceed_context_size_error" if e.code == "context_length_exceeded" else \
        LLAMA_ERROR_TYPES.get(e.status, "invalid_request_error")
    return {"error": {"code": e.status, "message": e.message, "type": kind}}


def _bad(msg: str) -> ApiError:
    return ApiError(400, msg)


def _flag(body: dict, key: str, default: bool) -> bool:
    v = body.get(key, default)
    if not isinstance(v, bool):
        raise _bad(f"'{key}' must be a boolean, got {schema._tname(v)}")
    return v


def _token_ids(v, key: str, n_vocab: int) -> list[int]:
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        raise _bad(f"'{key}' must be an array of token ids")
    bad = outside_vocab(v, n_vocab)
    if bad is not None:
        raise _bad(f"'{key}' holds token id {bad} outside the vocabulary [0, {n_vocab})")
    return list(v)


def _piece(tok, token_id: int):
    """A token's piece as llama-server gives it: its text (special tokens included) when the bytes are valid UTF-8,
    else the list of its byte values."""
    b = tok.token_piece(token_id, special=True)
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return list(b)


async def tokenize(request: web.Request) -> web.Response:
    """POST /tokenize {content: str | [str | id, ...], add_special=false, parse_special=true, with_pieces=false}
    -> {"tokens": [id, ...]} or {"tokens": [{"id", "piece"}, ...]}. In an array, ids pass through and only the first
    element may get BOS (llama-server's tokenize_mixed)."""
    body = await read_body(request)
    engine = engine_of(request)
    tok = engine.tokenizer

    def check() -> list:
        content = body.get("content")
        if content is None:
            raise _bad("'content' is required: the text to tokenize")
        if isinstance(content, str):
            parts: list = [content]
        elif isinstance(content, list) and all(isinstance(p, str) or (isinstance(p, int) and not isinstance(p, bool))
                                               for p in content):
            parts = content
        else:
            raise _bad(f"'content' must be a string or an array of strings and token ids, got "
                       f"{schema._tname(content)}")
        return parts
    parts = await prepared(request, check)
    add_special = _flag(body, "add_special", False)
    parse_special = _flag(body, "parse_special", True)
    with_pieces = _flag(body, "with_pieces", False)
    await prepared(request, lambda: _token_ids([p for p in parts if isinstance(p, int)], "content", tok.n_vocab))

    def run() -> list[int]:
        ids: list[int] = []
        for i, p in enumerate(parts):
            if isinstance(p, int):
                ids.append(p)
            else:
                kw = {} if add_special and i == 0 else {"add_bos": False, "add_eos": False}
                ids.extend(tok.encode(p, parse_special=parse_special, **kw))
        return ids

    try:                                 # queued with the model's work: text tokenizes on the engine thread
        ids = await engine_call(request, lambda _engine: run())
    except ApiError as e:
        if e.status == 400:              # a lone surrogate: no UTF-8, so no tokens
            raise _bad(f"'content': {e.message}") from None
        raise
    if with_pieces:
        return json_response({"tokens": await prepared(request, lambda: [{"id": i, "piece": _piece(tok, i)}
                                                                         for i in ids])})
    return json_response({"tokens": ids})


async def detokenize(request: web.Request) -> web.Response:
    """POST /detokenize {tokens: [id, ...]} -> {"content": text}: the tokens' pieces joined, special tokens as their
    text (llama-server's tokens_to_str); bytes that are not UTF-8 become U+FFFD."""
    body = await read_body(request)
    engine = engine_of(request)
    tok = engine.tokenizer
    return json_response({"content": await prepared(
        request, lambda: tok.decode(_token_ids(body.get("tokens", []), "tokens", tok.n_vocab), special=True))})


async def apply_template(request: web.Request) -> web.Response:
    """POST /apply-template {messages, tools?, add_generation_prompt?} (as /v1/chat/completions takes them) ->
    {"prompt": text}: the prompt the chat route would read (tools as it gives them to the model, the generic
    family's system prompt included), nothing generated."""
    body = await read_body(request)
    p = await prepared(request, lambda: schema.parse_chat(body))
    engine = engine_of(request)
    if engine.template is None:
        raise _bad(f"{engine.model_name} has no usable chat template ({engine._template_error})")
    agp = body.get("add_generation_prompt", True)
    if not isinstance(agp, bool):
        raise _bad("'add_generation_prompt' must be a boolean")
    try:
        def render() -> str:
            plan = structured.plan_chat(engine, p)    # the prompt /v1/chat/completions reads: tools as it injects them
            return engine.template.render_text(plan.messages, add_generation_prompt=agp, tools=plan.tools,
                                               **plan.template_kwargs)
        text = await prepared(request, render, heavy=True)
    except ValueError as e:
        raise _bad(f"the chat template refused the messages: {e}") from None
    return json_response({"prompt": text})


async def props(request: web.Request) -> web.Response:
    """GET /props: llama-server's global properties, those Strata has (its slots, the sampling defaults, the model's
    path, chat template, BOS / EOS text)."""
    from dataclasses import fields

    from strata.sampling.sampler import SamplingParams
    engine = engine_of(request)
    w = request.app[WORKER_KEY]
    tok = engine.tokenizer
    d = {f.name: f.default for f in fields(SamplingParams)}
    params = {"n_predict": request.app[CONFIG_KEY].n_predict, "seed": 4294967295, "temperature": d["temperature"], "top_k": d["top_k"],
              "top_p": d["top_p"], "min_p": d["min_p"], "repeat_last_n": d["repeat_last_n"],
              "repeat_penalty": d["repeat_penalty"], "presence_penalty": d["presence_penalty"],
              "frequency_penalty": d["frequency_penalty"], "stop": [], "max_tokens": -1, "n_probs": 0,
              "samplers": ["penalties", "top_k", "top_p", "min_p", "temperature"],
              "speculative.n_max": int(getattr(engine, "spec", 0))}
    tmpl = engine.template
    return json_response({
        "default_generation_settings": {"id": 0, "id_task": -1, "n_ctx": engine.n_ctx,
                                        "speculative": int(getattr(engine, "spec", 0)) > 0,
                                        "is_processing": w.running is not None, "params": params},
        "total_slots": int(getattr(engine, "parallel", 1)),
        "model_path": engine.model_path,
        "chat_template": tmpl.source if tmpl is not None else "",
        "bos_token": tok.tokens[tok.bos_id] if tok.bos_id is not None else "",
        "eos_token": tok.tokens[tok.eos_id] if tok.eos_id is not None else "",
        "modalities": {"vision": False, "audio": False},
        "build_info": f"strata-{__version__}",
    })


# ---------------------------------------------------------------------------------------------- /completion
#: /completion's fields -> the completion route's (llama-server's names where they differ)
_COMPLETION_FIELDS = ("prompt", "temperature", "top_k", "top_p", "min_p", "seed", "stop", "stream", "cache_prompt",
                      "repeat_penalty", "repeat_last_n", "presence_penalty", "frequency_penalty", "json_schema",
                      "grammar", "strata_checkpoint", "strata_spec", "logit_bias")


#: the completion route's field names -> /completion's, for its refusals
_RENAMES = [(re.compile(r"\bmax_tokens\b"), "n_predict")]


def completion_request(body: dict, engine) -> schema.ParsedRequest:
    fields = {k: body[k] for k in _COMPLETION_FIELDS if k in body and body[k] is not None}
    n = body.get("n_predict", body.get("max_tokens"))
    if n is not None:
        if isinstance(n, bool) or not isinstance(n, int) or n < -1:
            raise _bad("'n_predict' must be an integer >= -1 (-1: until the model stops or the context is full)")
        if n >= 0:
            fields["max_tokens"] = n
        else:
            fields["max_tokens"] = whole_context(engine)
    if body.get("n_probs"):
        raise ApiError(400, "'n_probs' is not supported on /completion: /v1/completions gives logprobs",
                            code="unsupported_value")
    from strata.engine.slots import slot_error
    slot = body.get("id_slot")
    slot = -1 if slot is None else slot              # null: any slot (llama-server reads null as the default)
    n_slots = int(getattr(engine, "parallel", 1))
    if isinstance(slot, bool) or not isinstance(slot, int) or not -1 <= slot < n_slots:
        raise _bad(slot_error(slot, n_slots))
    fields["id_slot"] = slot
    return schema.parse_completion(fields)


def _prompt_text(engine, prompt) -> str:
    """The answer's "prompt": a text prompt as sent; token ids detokenized, special tokens as their text (what
    llama-server answers for either: its task's tokens detokenized)."""
    return prompt if isinstance(prompt, str) else engine.tokenizer.decode(prompt or [], special=True)


def _completion_obj(final, content: str, p: schema.ParsedRequest, engine, prompt, n_predict: int = -1) -> dict:
    t = final.timings or {}
    by = (final.strata or {}).get("stopped_by")
    by = by if by is not None and by in p.stop else None     # an end-of-generation token is no stop word
    kind = "word" if by is not None else "limit" if final.finish_reason == "length" else \
        "none" if final.finish_reason == "cancelled" else "eos"
    return {"content": content, "id_slot": (final.strata or {}).get("id_slot", 0), "stop": True,
            "model": engine.model_name,
            "tokens_predicted": int(final.usage["completion_tokens"]), "tokens_evaluated": int(t.get("prompt_n", 0)),
            "tokens_cached": int(t.get("cache_n", 0)), "prompt": _prompt_text(engine, prompt),
            "has_new_line": "\n" in content, "truncated": False, "stop_type": kind,
            "stopping_word": by or "", "stopped_eos": kind == "eos", "stopped_limit": kind == "limit",
            "stopped_word": kind == "word",
            "generation_settings": {"n_predict": p.max_tokens if p.max_tokens is not None else n_predict,
                                    **p.sampling, "stop": p.stop,
                                    # llama-server's shape; a banned token's bias (-inf) as the false it was sent as
                                    "logit_bias": [{"token": t, "bias": False if b == -math.inf else b}
                                                   for t, b in p.sampling.get("logit_bias", ())]},
            "timings": {k: t.get(k) for k in ("prompt_n", "prompt_ms", "prompt_per_second", "predicted_n",
                                              "predicted_ms", "predicted_per_second", "cache_n")}}


async def completion_respond(request, engine, p, job, answers, return_tokens: bool = False):
    """llama-server's answer: one object, or SSE `data:` lines of {"content", "tokens", "stop": false} then the
    whole object with "stop": true (no [DONE] line). "tokens" holds the generated token ids (each chunk's, or all of
    them in the one object) when return_tokens, else [] (llama-server's return_tokens)."""
    if not p.stream:
        text, ids = [], []
        while True:
            ev = await next_event(job)
            text.append(ev.text or "")
            if isinstance(ev, FinalEvent):
                obj = _completion_obj(ev, "".join(text), p, engine, p.prompt, request.app[CONFIG_KEY].n_predict)
                return json_response({**obj, "tokens": ids if return_tokens else []})
            ids.append(int(ev.token_id))
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                       "Cache-Control": "no-cache", "X-Request-Id": request["rid"]})
    await resp.prepare(request)
    n = 0
    try:
        while True:
            ev = await next_event(job)
            if isinstance(ev, FinalEvent):
                obj = _completion_obj(ev, ev.text or "", p, engine, p.prompt, request.app[CONFIG_KEY].n_predict)
                await resp.write(b"data: " + json.dumps({**obj, "tokens": []}, ensure_ascii=False).encode() + b"\n\n")
                break
            n += 1
            chunk = {"content": ev.text, "tokens": [int(ev.token_id)] if return_tokens else [], "stop": False,
                     "id_slot": job.slot or 0, "tokens_predicted": n}
            await resp.write(b"data: " + json.dumps(chunk, ensure_ascii=False).encode() + b"\n\n")
    except ApiError as e:
        await resp.write(b"error: " + json.dumps(llama_error(e), ensure_ascii=False).encode() + b"\n\n")
    await resp.write_eof()
    return resp


async def completion(request: web.Request) -> web.StreamResponse:
    """POST /completion: llama-server's raw completion (prompt a string or token ids; n_predict; return_tokens;
    its answer shape)."""
    body = await read_body(request)
    engine = engine_of(request)
    try:
        p = await prepared(request, lambda: completion_request(body, engine))
        return await generate_completion(request, p, respond=functools.partial(
            completion_respond, return_tokens=_flag(body, "return_tokens", False)))
    except ApiError as e:                   # the completion route's max_tokens is this route's n_predict
        raise renamed(e, _RENAMES) from None


def add_routes(app: web.Application) -> None:
    """Register the routes and their error shape on `app` (make_app calls this)."""
    r = app.router
    routes = [r.add_post("/completion", completion), r.add_post("/tokenize", tokenize),
              r.add_post("/detokenize", detokenize), r.add_post("/apply-template", apply_template),
              r.add_get("/props", props)]
    for route in routes:
        app[ERROR_SHAPES_KEY][route.resource.canonical] = llama_error


__all__ = ["add_routes", "llama_error"]
