"""The aiohttp application: OpenAI-compatible routes, Strata's admin routes, auth, errors, request ids.

Routes: POST /v1/chat/completions, POST /v1/completions (JSON or SSE), GET /v1/models[/{id}], GET /health,
GET /metrics, GET /slots, POST /slots/{id}?action=save|restore|erase, GET /status, GET /cache; llama-server's
/tokenize, /detokenize, /apply-template, /props come from strata/serve/llama_api.py, OpenAI's /v1/responses from
strata/serve/responses_api.py, Anthropic's /v1/messages from strata/serve/messages_api.py (both through
generate_chat, the chat route's path), the web chat page (GET /, /web/...) from strata/serve/chat_page.py.
Every error is an OpenAI error object ({"error": {"message", "type", "param", "code"}}), except on routes that
register their API's own shape in ERROR_SHAPES_KEY.
"""
from __future__ import annotations

import asyncio
import codecs
import hmac
import json
import re
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import structlog
from aiohttp import web

from strata import __version__
from strata.engine.types import ContextOverflow, merge_choices
from strata.serve import chat_page, schema, structured
from strata.serve.errors import ApiError
from strata.serve.metrics import CONTENT_TYPE, Metrics
from strata.serve.worker import EngineError, EngineWorker, Job, QueueFull, ShuttingDown

log = structlog.get_logger("strata.serve")

_RID_OK = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")
SLOT_ACTIONS = ("save", "restore", "erase")


@dataclass
class ServeConfig:
    """What `strata serve` was asked for (the parsed flags that matter to the app)."""
    socket_path: str | None = None
    host: str | None = None
    port: int | None = None
    api_key: str | None = None
    queue_max: int = 16
    max_body: int = 8 * 1024 * 1024
    retry_after: int = 1
    drain_timeout: float = 30.0
    responses_store: int = 256        # /v1/responses kept for previous_response_id (strata.serve.responses_api)
    tcp_bound: str | None = None      # the TCP address actually bound ("[::1]:8090"; --port 0 gives the real port)

    def tcp_address(self) -> str | None:
        """host:port the TCP listener has (the bound one once known; IPv6 hosts in brackets), or None."""
        if self.port is None:
            return None
        if self.tcp_bound:
            return self.tcp_bound
        return format_hostport(self.host or "127.0.0.1", self.port)


def format_hostport(host: str, port: int) -> str:
    """host:port, with an IPv6 host in brackets ([::1]:8080), as URLs write it."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


CONFIG_KEY = web.AppKey("config", ServeConfig)
WORKER_KEY = web.AppKey("worker", EngineWorker)
METRICS_KEY = web.AppKey("metrics", Metrics)
STARTED_KEY = web.AppKey("started", float)
# route template -> the error body of that route's API (ApiError -> dict); routes not in it answer OpenAI's shape
ERROR_SHAPES_KEY = web.AppKey("error_shapes", dict)


def _json(data: Any, status: int = 200, headers: dict | None = None) -> web.Response:
    return web.Response(body=json.dumps(data, ensure_ascii=False).encode(), status=status,
                        content_type="application/json", headers=headers)


def _is_unix(request: web.Request) -> bool:
    tr = request.transport
    sock = tr.get_extra_info("socket") if tr is not None else None
    return sock is not None and sock.family == socket.AF_UNIX


async def _route_name(request: web.Request) -> str:
    """The matched route's template for the metrics label; for a method the route does not take (405), the
    template of the route whose path matched (asked of each resource as the router asks it); "unmatched" when no
    route's path does."""
    try:
        res = request.match_info.route.resource
    except AttributeError:
        res = None
    if res is not None:
        return res.canonical
    if getattr(request.match_info.http_exception, "status", None) == 405:
        for r in request.app.router.resources():
            _match, allowed = await r.resolve(request)
            if allowed:                    # the path matched; only the method did not
                return r.canonical
    return "unmatched"


def _api_key_of(request: web.Request) -> str:
    """The key a client sent: 'Authorization: Bearer <key>' (OpenAI's clients) or 'x-api-key: <key>' (Anthropic's)."""
    got = request.headers.get("Authorization", "")
    if got[:7].lower() == "bearer ":
        return got[7:]
    return request.headers.get("x-api-key", "")


@web.middleware
async def middleware(request: web.Request, handler):
    """Request id on every log line, API-key check on TCP, exceptions -> error objects in the route's API's shape,
    metrics."""
    rid = request.headers.get("X-Request-Id", "")
    if not _RID_OK.match(rid):
        rid = uuid.uuid4().hex[:16]
    request["rid"] = rid
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(request_id=rid)
    cfg = request.app[CONFIG_KEY]
    t0 = time.perf_counter()
    status = 500
    try:
        if cfg.api_key and request.path != "/health" and not chat_page.is_public(request.path) \
                and not _is_unix(request):
            if not hmac.compare_digest(_api_key_of(request).encode(), cfg.api_key.encode()):
                raise ApiError(401, "invalid or missing API key: send 'Authorization: Bearer <key>' or "
                                    "'x-api-key: <key>'", code="invalid_api_key",
                               headers={"WWW-Authenticate": "Bearer"})
        resp = await handler(request)
    except ApiError as e:
        resp = await _err_for(request, e)
    except web.HTTPException as e:
        if e.status == 404:
            msg = f"unknown route: {request.method} {request.path}"
        elif e.status == 405:
            msg = f"method {request.method} is not allowed on {request.path}"
        elif e.status == 413:
            msg = f"the request body is larger than --max-body ({cfg.max_body} bytes)"
        else:
            msg = e.reason or str(e)
        resp = await _err_for(request, ApiError(e.status, msg, code={404: "not_found", 413: "request_too_large"}.get(
            e.status)))
    except asyncio.CancelledError:
        log.info("request cancelled", method=request.method, path=request.path,
                 ms=round((time.perf_counter() - t0) * 1e3, 2), reason="client disconnected or shutdown")
        request.app[METRICS_KEY].requests.labels(route=await _route_name(request), status="499").inc()
        raise
    except Exception as e:  # noqa: BLE001 - nothing a client sends may crash the daemon
        log.exception("request failed", error=f"{type(e).__name__}: {e}")
        resp = await _err_for(request, ApiError(500, f"internal error: {type(e).__name__}: {e}"))
    status = resp.status
    if not resp.prepared:
        resp.headers["X-Request-Id"] = rid
    request.app[METRICS_KEY].requests.labels(route=await _route_name(request), status=str(status)).inc()
    log.info("request", method=request.method, path=request.path, status=status,
             ms=round((time.perf_counter() - t0) * 1e3, 2))
    return resp


async def _err_for(request: web.Request, e: ApiError) -> web.Response:
    """The error response in the shape of the API the route belongs to (ERROR_SHAPES_KEY), else e's own."""
    shape = request.app[ERROR_SHAPES_KEY].get(await _route_name(request))
    return _json(shape(e) if shape is not None else e.body(), e.status, e.headers)


# ---------------------------------------------------------------------------------------------- helpers
def _engine(request: web.Request):
    w = request.app[WORKER_KEY]
    if w.engine is None:
        if w.load_error is not None:
            raise ApiError(503, f"the model failed to load: {w.load_error}", code="model_load_failed")
        raise ApiError(503, "the model is still loading", code="loading", headers={"Retry-After": "1"})
    return w.engine


def _serving_engine(request: web.Request):
    """_engine, and 503 at once (code worker_unavailable) while a remote stage's link is down."""
    engine = _engine(request)
    why = engine.unavailable() if hasattr(engine, "unavailable") else None
    if why:
        raise ApiError(503, why, code="worker_unavailable", headers={"Retry-After": "1"})
    return engine


def _model_ids(engine) -> list[str]:
    return [engine.model_name]


def _check_model(engine, model: str | None) -> None:
    if model is None or model in _model_ids(engine) or model == "default":
        return
    raise ApiError(404, f"the model {model!r} does not exist: this daemon serves {engine.model_name!r}",
                   param="model", code="model_not_found")


async def _read_body(request: web.Request) -> dict:
    cfg = request.app[CONFIG_KEY]
    if request.content_length is not None and request.content_length > cfg.max_body:
        raise ApiError(413, f"the request body is {request.content_length} bytes, more than --max-body "
                            f"({cfg.max_body} bytes)", code="request_too_large")
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise ApiError(413, f"the request body is larger than --max-body ({cfg.max_body} bytes)",
                       code="request_too_large") from None
    except web.RequestPayloadError as e:   # e.g. a Content-Encoding the body does not decode with
        enc = request.headers.get("Content-Encoding")
        why = " ".join(str(e).split()).removeprefix("400, message: ")
        raise ApiError(400, f"the request body could not be read{f' (Content-Encoding {enc})' if enc else ''}: "
                            f"{why}") from None
    return schema.parse_json(raw)


def _engine_error(err: EngineError) -> ApiError:
    e = err.exc
    if isinstance(e, ApiError):
        return e
    if isinstance(e, ShuttingDown):
        return ApiError(503, "the server is shutting down", code="shutting_down", headers={"Retry-After": "5"})
    name = type(e).__name__
    if getattr(e, "http_status", None):     # a stage link failure (strata.stages.remote): 503 with its code
        return ApiError(int(e.http_status), str(e), code=getattr(e, "api_code", "engine_error"))
    if name == "ContextOverflow":
        return ApiError(400, str(e), param="messages", code="context_length_exceeded")
    if name == "MaxTokensTooLarge":
        return ApiError(400, str(e), param="max_tokens", code="invalid_value")
    if isinstance(e, ValueError):
        return ApiError(400, str(e), code="invalid_value")
    return ApiError(500, f"the engine failed: {name}: {e}", code="engine_error")


def _sampling(p: schema.ParsedRequest):
    from strata.sampling import SamplingParams
    try:
        return SamplingParams(**p.sampling)
    except (ValueError, TypeError) as e:
        raise ApiError(400, f"bad sampling parameters: {e}", code="invalid_value") from None


def _token_text(engine, token_id: int) -> str:
    return engine.detokenize([token_id])


def _lp_entry(engine, token_id: int, text: str, lp: float) -> dict:
    """One OpenAI logprobs entry: `bytes` are the token's own bytes (so that joining them rebuilds text a character
    of which spans several tokens), not the UTF-8 of its (possibly U+FFFD) text."""
    raw = engine.token_bytes(token_id) if hasattr(engine, "token_bytes") else text.encode("utf-8", "replace")
    return {"token": text, "logprob": lp, "bytes": list(raw)}


# ---------------------------------------------------------------------------------------------- routes
async def health(request: web.Request) -> web.Response:
    w = request.app[WORKER_KEY]
    if w.engine is None:
        return _json({"status": "loading" if w.load_error is None else "error"}, 503)
    why = w.engine.unavailable() if hasattr(w.engine, "unavailable") else None
    if why:
        return _json({"status": "unavailable", "error": why}, 503)
    return _json({"status": "ok" if not w.closing else "stopping", "model": w.engine.model_name,
                  "queue": {"running": int(w.running is not None), "waiting": w.waiting, "max": w.queue_max}},
                 200 if not w.closing else 503)


async def models(request: web.Request) -> web.Response:
    engine = _engine(request)
    return _json({"object": "list", "data": [_model_obj(request, engine)]})


def _model_obj(request, engine) -> dict:
    return {"id": engine.model_name, "object": "model", "created": int(request.app[STARTED_KEY]),
            "owned_by": "strata", "meta": {"n_ctx": engine.n_ctx, "arch": getattr(engine, "arch", None),
                                           "n_vocab": getattr(engine, "n_vocab", None),
                                           "path": getattr(engine, "model_path", None)}}


async def model_one(request: web.Request) -> web.Response:
    engine = _engine(request)
    _check_model(engine, request.match_info["model"])
    return _json(_model_obj(request, engine))


async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[METRICS_KEY].render(), headers={"Content-Type": CONTENT_TYPE})


def _engine_status(engine) -> dict:
    for _ in range(3):  # read from the loop while the engine thread may be appending checkpoints
        try:
            return engine.status()
        except RuntimeError:
            continue
    return engine.status()


async def status(request: web.Request) -> web.Response:
    engine = _engine(request)
    w = request.app[WORKER_KEY]
    cfg = request.app[CONFIG_KEY]
    st = _engine_status(engine)
    return _json({
        "version": __version__, "model": engine.model_name, "uptime_s": round(time.time() - request.app[STARTED_KEY], 1),
        "stages": [{"stage": s["index"], "device": s["device"], "layers": [s["layer_lo"], s["layer_hi"]],
                    "remote": "link" in s, "runner": s["runner"], "memory": s["memory"],
                    **({"link": s["link"]} if "link" in s else {})} for s in st.get("stages", [])],
        "queue": {"running": int(w.running is not None), "waiting": w.waiting, "max": w.queue_max},
        "listen": {"socket": cfg.socket_path, "tcp": cfg.tcp_address()},
        "device": engine.device_info(),
        "engine": st,
    })


async def cache(request: web.Request) -> web.Response:
    engine = _engine(request)
    st = _engine_status(engine)
    return _json({"prompt_cache": st.get("prompt_cache"), "checkpoint_bytes": st.get("checkpoint_bytes"),
                  "pos": st.get("pos"), "checkpoints": st.get("checkpoints", []), "parked": st.get("parked", []),
                  "conversation_cache_bytes": st.get("conversation_cache_bytes", 0)})


async def slots(request: web.Request) -> web.Response:
    engine = _engine(request)
    w = request.app[WORKER_KEY]
    st = _engine_status(engine)
    return _json([{"id": 0, "n_ctx": engine.n_ctx, "is_processing": w.running is not None,
                   "state": "processing" if w.running is not None else "idle", "pos": st.get("pos"),
                   "model": engine.model_name, "checkpoints": len(st.get("checkpoints", []))}])


async def slot_action(request: web.Request) -> web.Response:
    engine = _engine(request)
    sid = request.match_info["slot"]
    if not sid.isdigit():
        raise ApiError(400, f"slot id must be a non-negative integer, got {sid!r}", param="id", code="invalid_value")
    if int(sid) != 0:
        raise ApiError(404, f"slot {int(sid)} does not exist: this daemon has one slot (0)", code="not_found")
    action = request.query.get("action")
    if action not in SLOT_ACTIONS:
        raise ApiError(400, f"'action' must be one of {', '.join(SLOT_ACTIONS)}, got {action!r}", param="action",
                       code="invalid_value")
    body = {}
    if request.can_read_body:
        body = await _read_body(request)
    fn = getattr(engine, f"slot_{action}")
    # llama-server's request shape: {"filename": ...} for save / restore; anything else in the body is ignored
    kw = {"filename": body["filename"]} if action != "erase" and "filename" in body else {}
    if action != "erase" and not kw:
        raise ApiError(400, f"slot {action} needs a JSON body with \"filename\"", param="filename",
                       code="invalid_value")
    w = request.app[WORKER_KEY]
    job = _submit(w, lambda eng: fn(0, **kw), call=True, rid=request["rid"])
    item = await job.events.get()
    if isinstance(item, EngineError):
        raise _engine_error(item)
    return _json(item[1] if isinstance(item[1], dict) else {"id": 0, "action": action, "result": item[1]})


def _submit(w: EngineWorker, what, *, call: bool = False, rid: str = "") -> Job:
    try:
        return w.call(what, rid) if call else w.submit(what, rid)
    except QueueFull as e:
        raise ApiError(503, f"the server is busy: {e}; retry later", code="queue_full",
                       headers={"Retry-After": str(1)}) from None
    except ShuttingDown:
        raise ApiError(503, "the server is shutting down", code="shutting_down",
                       headers={"Retry-After": "5"}) from None


async def chat_completions(request: web.Request) -> web.StreamResponse:
    body = await _read_body(request)
    return await generate_chat(request, schema.parse_chat(body))


async def render_chat(request: web.Request, p: schema.ParsedRequest):
    """A parsed chat request on the serving engine, rendered by its template: (engine, plan, rendered). The model is
    checked first; a refusal of the template or a prompt too long to render is an ApiError naming 'messages'."""
    engine = _serving_engine(request)
    _check_model(engine, p.model)
    plan = structured.plan_chat(engine, p)           # tools, reasoning, response_format (strata.serve.structured)
    loop = asyncio.get_running_loop()
    try:
        rendered = await loop.run_in_executor(
            None, lambda: engine.render_chat(plan.messages, tools=plan.tools, pin_message=plan.pin,
                                             **plan.template_kwargs))
    except ContextOverflow as e:         # too long to be worth rendering and tokenizing
        raise ApiError(400, str(e), param="messages", code="context_length_exceeded") from None
    except ValueError as e:
        raise ApiError(400, f"the chat template refused the messages: {e}", param="messages",
                       code="invalid_value") from None
    structured.after_render(plan, rendered.text)
    return engine, plan, rendered


async def generate_chat(request: web.Request, p: schema.ParsedRequest, respond=None) -> web.StreamResponse:
    """Answer a parsed chat request: rendered (render_chat), constrained, generated. respond(request, engine, p, job,
    answers) sends the answer (default: the chat completion's JSON or SSE); the Responses and Messages routes pass
    their own."""
    engine, plan, rendered = await render_chat(request, p)
    constraint = await asyncio.get_running_loop().run_in_executor(
        None, lambda: structured.chat_constraint(engine, plan, structured.param_of(p)))
    return await _generate(request, engine, p, list(rendered.tokens), list(rendered.cut_points), plan=plan,
                           constraint=constraint, respond=respond)


async def completions(request: web.Request) -> web.StreamResponse:
    body = await _read_body(request)
    p = schema.parse_completion(body)
    engine = _serving_engine(request)
    _check_model(engine, p.model)
    if isinstance(p.prompt, str):
        text = p.prompt
        try:
            tokens = await asyncio.get_running_loop().run_in_executor(None, lambda: engine.tokenize_prompt(text))
        except ContextOverflow as e:
            raise ApiError(400, str(e), param="prompt", code="context_length_exceeded") from None
        except ValueError as e:          # e.g. a lone surrogate: no UTF-8 encoding, so no tokens
            raise ApiError(400, f"'prompt': {e}", param="prompt", code="invalid_value") from None
    else:
        tokens = p.prompt
        n_vocab = getattr(engine, "n_vocab", None)
        bad = _outside_vocab(tokens, n_vocab)
        if bad is not None:
            raise ApiError(400, f"'prompt' holds token id {bad} outside the vocabulary [0, {n_vocab})",
                           param="prompt", code="invalid_value")
    constraint = await asyncio.get_running_loop().run_in_executor(
        None, lambda: structured.completion_constraint(engine, p))
    return await _generate(request, engine, p, list(tokens), [], constraint=constraint)


def _outside_vocab(tokens: list[int], n_vocab: int | None) -> int | None:
    """The first token id below 0 or (when n_vocab is known) not below n_vocab, or None. min / max run in C: only
    a prompt that holds such an id is looked through token by token."""
    if min(tokens) >= 0 and (n_vocab is None or max(tokens) < n_vocab):
        return None
    return next(t for t in tokens if t < 0 or (n_vocab is not None and t >= n_vocab))


async def _generate(request: web.Request, engine, p: schema.ParsedRequest, tokens: list[int],
                    cut_points: list, plan: structured.ChatPlan | None = None,
                    constraint=None, respond=None) -> web.StreamResponse:
    from strata.engine.types import GenerationRequest
    from strata.token_ids import as_ids          # one conversion: validate and generate read it as it is

    n_ctx = engine.n_ctx
    if len(tokens) >= n_ctx:
        raise ApiError(400, f"the prompt has {len(tokens)} tokens but the context holds {n_ctx} (at most "
                            f"{n_ctx - 1} prompt tokens, leaving room for one generated token)",
                       param="messages" if p.kind == "chat" else "prompt", code="context_length_exceeded")
    if not tokens:
        raise ApiError(400, "the prompt is empty: at least one token is needed", param="prompt",
                       code="invalid_value")
    try:
        greq = GenerationRequest(prompt_tokens=as_ids(tokens), cut_points=cut_points, sampling=_sampling(p),
                                 max_tokens=p.max_tokens, stop=p.stop,
                                 logprobs=p.top_logprobs if p.logprobs else None,
                                 cache_prompt=p.cache_prompt, checkpoint=p.checkpoint, n=p.n,
                                 cancel=threading.Event(),
                                 constraint=constraint, show_tokens=plan.show_tokens if plan else frozenset())
        engine.validate(greq)              # refused now rather than after the queue (max_tokens past n_ctx_train, ...)
    except ValueError as e:
        raise _engine_error(EngineError(e)) from None
    w = request.app[WORKER_KEY]
    job = _submit(w, greq, rid=request["rid"])
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


async def _next(job: Job):
    item = await job.events.get()
    if isinstance(item, EngineError):
        raise _engine_error(item)
    return item


def _usage(final) -> dict:
    u = dict(final.usage)
    u["prompt_tokens_details"] = {"cached_tokens": int(final.timings.get("cache_n", 0) or 0)}
    return u


def _timings(final) -> dict:
    t = dict(final.timings)
    for k in ("prompt_ms", "predicted_ms", "prompt_per_second", "predicted_per_second"):
        if k in t and t[k] is not None:
            t[k] = round(float(t[k]), 3)
    return t


def _strata_obj(final) -> dict:
    s = dict(final.strata or {})
    if "parts" in s:
        s["parts"] = [list(x) for x in s["parts"]]
    return s


class _LogprobsAcc:
    """Collects per-token logprobs in the chat format (content list) or the legacy completions format, covering
    exactly the text the answer returns: an entry is held back while its token's text is (a possible stop string
    or an incomplete UTF-8 sequence held back by the engine), released with the text, and dropped if that text
    never comes (the stop string cut from the answer). text_offset: the character offset in the answer where the
    token's text starts (tokens splitting one character share its offset)."""

    def __init__(self, engine, kind: str):
        self.engine, self.kind = engine, kind
        self.content: list[dict] = []
        self.tokens, self.token_logprobs, self.top, self.offsets = [], [], [], []
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._chars = 0                           # characters of all tokens' bytes decoded so far
        self._released = 0                        # characters of the answer released so far
        self._pending: list[tuple[int, Any]] = []  # (offset, entry) not yet covered by released text

    def add(self, ev, emitted: str) -> dict | None:
        """Take one TokenEvent (emitted: the text it released); returns the entries released now, as one chunk's
        logprobs, or None."""
        if ev.logprob is None:
            return None
        text = _token_text(self.engine, ev.token_id)
        raw = self.engine.token_bytes(ev.token_id) if hasattr(self.engine, "token_bytes") else text.encode()
        offset = self._chars
        self._chars += len(self._decoder.decode(raw))
        tops = ev.top_logprobs or []
        if self.kind == "chat":
            entry: Any = _lp_entry(self.engine, ev.token_id, text, ev.logprob)
            entry["top_logprobs"] = [_lp_entry(self.engine, i, t, lp) for (i, t, lp) in tops]
        else:
            top: dict[str, float] = {}
            for (_i, t, lp) in tops:
                top.setdefault(t, lp)
            entry = (text, ev.logprob, top)
        self._pending.append((offset, entry))
        return self._release(len(emitted))

    def finish(self, tail: str) -> dict | None:
        """The end of the answer (tail: the FinalEvent's held-back text): entries it covers are released, the rest
        (a stop string's tokens) dropped."""
        out = self._release(len(tail))
        self._pending.clear()
        return out

    def _release(self, n_chars: int) -> dict | None:
        self._released += n_chars
        done = []
        while self._pending and self._pending[0][0] < self._released:
            done.append(self._pending.pop(0))
        if not done:
            return None
        if self.kind == "chat":
            entries = [e for _, e in done]
            self.content.extend(entries)
            return {"content": entries}
        chunk = {"tokens": [e[0] for _, e in done], "token_logprobs": [e[1] for _, e in done],
                 "top_logprobs": [e[2] for _, e in done], "text_offset": [o for o, _ in done]}
        self.tokens += chunk["tokens"]
        self.token_logprobs += chunk["token_logprobs"]
        self.top += chunk["top_logprobs"]
        self.offsets += chunk["text_offset"]
        return chunk

    def result(self) -> dict:
        if self.kind == "chat":
            return {"content": self.content}
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs, "top_logprobs": self.top,
                "text_offset": self.offsets}


async def _collect(request, engine, p, job, answers: list | None = None) -> web.Response:
    answers = answers or [None] * p.n
    pieces: list[list[str]] = [[] for _ in range(p.n)]
    accs = [_LogprobsAcc(engine, p.kind) for _ in range(p.n)]
    finals = []
    while len(finals) < p.n:
        ev = await _next(job)
        if hasattr(ev, "finish_reason"):
            finals.append(ev)
            pieces[ev.index].append(ev.text or "")
            accs[ev.index].finish(ev.text or "")
            continue
        pieces[ev.index].append(ev.text)
        accs[ev.index].add(ev, ev.text)
    cid, created = _ids(request, p)
    choices = []
    for f in finals:
        text = "".join(pieces[f.index])
        lp = accs[f.index].result() if p.logprobs else None
        if p.kind == "chat":
            message, finish, answer = {"role": "assistant", "content": text}, f.finish_reason, answers[f.index]
            if answer is not None:
                answer.feed(text)
                answer.finish()
                message, finish = answer.message(), answer.finish_reason(finish)
            choices.append({"index": f.index, "message": message, "logprobs": lp, "finish_reason": finish})
        else:
            choices.append({"index": f.index, "text": text, "logprobs": lp, "finish_reason": f.finish_reason})
    final = merge_choices(finals)
    return _json({"id": cid, "object": "chat.completion" if p.kind == "chat" else "text_completion",
                  "created": created, "model": engine.model_name, "system_fingerprint": f"strata-{__version__}",
                  "choices": choices, "usage": _usage(final), "timings": _timings(final),
                  "strata": _strata_obj(final)})


async def _stream(request, engine, p, job, answers: list | None = None) -> web.StreamResponse:
    """SSE chunks, each choice's (its `index`) in turn; the last choice's finish chunk carries the request's timings
    and strata, the usage chunk (include_usage) sums the choices. A chat answer with a parser (tools, reasoning) is
    taken apart into content / reasoning_content / tool_calls deltas."""
    answers = answers or [None] * p.n
    cid, created = _ids(request, p)
    chat = p.kind == "chat"
    base = {"id": cid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": engine.model_name, "system_fingerprint": f"strata-{__version__}"}
    accs = [_LogprobsAcc(engine, p.kind) for _ in range(p.n)]
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

    async def pieces(i: int, text: str, lp, end: bool = False) -> None:
        """One event's text of choice i as chunks: a chat answer taken apart (content / reasoning_content /
        tool_calls deltas, the logprobs on the first), else as text."""
        answer = answers[i]
        if answer is None:
            if text or lp is not None:
                await resp.write(chunk([choice(i, text, lp)]))
            return
        deltas = answer.feed(text) + (answer.finish() if end else [])
        if not deltas and lp is not None:
            deltas = [{"content": ""}]
        for k, d in enumerate(deltas):
            await resp.write(chunk([{"index": i, "delta": d, "logprobs": lp if k == 0 else None,
                                     "finish_reason": None}]))

    try:
        while True:
            try:
                ev = await _next(job)
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
            if hasattr(ev, "finish_reason"):
                finals.append(ev)
                tail = ev.text or ""
                lp = accs[i].finish(tail) if p.logprobs else None
                await pieces(i, tail, lp, end=True)
                finish = answers[i].finish_reason(ev.finish_reason) if answers[i] is not None else ev.finish_reason
                if len(finals) < p.n:
                    await resp.write(chunk([choice(i, None if chat else "", None, finish)]))
                    continue
                final = merge_choices(finals)
                await resp.write(chunk([choice(i, None if chat else "", None, finish)],
                                       timings=_timings(final), strata=_strata_obj(final)))
                if p.include_usage:
                    await resp.write(chunk([], usage=_usage(final)))
                await resp.write(b"data: [DONE]\n\n")
                await resp.write_eof()
                return resp
            lp = accs[i].add(ev, ev.text) if p.logprobs else None
            await pieces(i, ev.text, lp)
    except (ConnectionResetError, ConnectionError) as e:
        log.info("client disconnected mid-stream", error=str(e) or type(e).__name__)
        request.app[WORKER_KEY].drop(job)
        return resp if resp is not None else web.Response(status=499)


def make_app(cfg: ServeConfig, worker: EngineWorker, metrics_: Metrics) -> web.Application:
    """Build the application; `worker` owns the engine thread (started by the caller)."""
    app = web.Application(middlewares=[middleware], client_max_size=cfg.max_body)
    app[CONFIG_KEY] = cfg
    app[WORKER_KEY] = worker
    app[METRICS_KEY] = metrics_
    app[STARTED_KEY] = time.time()
    app[ERROR_SHAPES_KEY] = {}
    r = app.router
    r.add_post("/v1/chat/completions", chat_completions)
    r.add_post("/chat/completions", chat_completions)
    r.add_post("/v1/completions", completions)
    r.add_post("/completions", completions)
    r.add_get("/v1/models", models)
    r.add_get("/v1/models/{model}", model_one)
    r.add_get("/health", health)
    r.add_get("/v1/health", health)
    r.add_get("/metrics", metrics)
    r.add_get("/slots", slots)
    r.add_post("/slots/{slot}", slot_action)
    r.add_get("/status", status)
    r.add_get("/cache", cache)
    from strata.serve import llama_api          # llama-server's /tokenize, /detokenize, /apply-template, /props
    llama_api.add_routes(app)
    chat_page.add_routes(app)
    from strata.serve import messages_api, responses_api
    responses_api.add_routes(app)               # OpenAI's /v1/responses
    messages_api.add_routes(app)                # Anthropic's /v1/messages
    return app
