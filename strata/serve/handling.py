"""What the route handlers share: JSON responses, the body read under --max-body (parsed and validated in the
preparation pool when large), the engine (503 while it loads or a remote stage is down), the model check, jobs
submitted to the worker and their events, engine errors as ApiErrors."""
from __future__ import annotations

import asyncio
import json
import socket
from typing import Any, Callable

from aiohttp import web

from strata.serve import body_coding, prepare, schema
from strata.serve.config import CONFIG_KEY, WORKER_KEY
from strata.errors import EngineFault, Refused, Unavailable
from strata.serve.errors import ApiError, refusal
from strata.serve.log import malformed
from strata.serve.worker import EngineError, EngineWorker, Job, QueueFull, ShuttingDown


def is_unix(request: web.Request) -> bool:
    """Whether the request came over the Unix socket (whose file mode is its boundary: no key, no browser checks)."""
    tr = request.transport
    sock = tr.get_extra_info("socket") if tr is not None else None
    return sock is not None and sock.family == socket.AF_UNIX


def json_response(data: Any, status: int = 200, headers: dict | None = None) -> web.Response:
    """`data` as a JSON response (UTF-8, non-ASCII kept as it is)."""
    return web.Response(body=json.dumps(data, ensure_ascii=False).encode(), status=status,
                        content_type="application/json", headers=headers)


def engine_of(request: web.Request):
    """The loaded engine; 503 while it loads (code loading) or when it failed to (model_load_failed)."""
    w = request.app[WORKER_KEY]
    if w.engine is None:
        if w.load_error is not None:
            raise ApiError(503, f"the model failed to load: {w.load_error}", code="model_load_failed")
        raise ApiError(503, "the model is still loading", code="loading", headers={"Retry-After": "1"})
    return w.engine


def serving_engine(request: web.Request):
    """engine_of, and 503 at once (code worker_unavailable) while a remote stage's link is down."""
    engine = engine_of(request)
    why = engine.unavailable() if hasattr(engine, "unavailable") else None
    if why:
        raise ApiError(503, why, code="worker_unavailable", headers={"Retry-After": "1"})
    return engine


def served_names(request: web.Request, engine) -> list[str]:
    """The names the loaded model answers to in /v1/models: its file's stem, then every --alias. A generation
    request may name any model (one is loaded, as with llama-server): its `model` field is not checked."""
    return [engine.model_name, *(a for a in request.app[CONFIG_KEY].aliases if a != engine.model_name)]


def check_model(request: web.Request, engine, model: str) -> None:
    """404 (model_not_found) when GET /v1/models/{model} names none of served_names ("default" is one too)."""
    if model in served_names(request, engine) or model == "default":
        return
    raise ApiError(404, f"the model {model!r} does not exist: this daemon serves {engine.model_name!r}",
                   param="model", code="model_not_found")


def n_ctx_train(engine) -> int:
    """The model's training context (GGUF metadata; 0 when it does not say)."""
    return int(getattr(getattr(engine, "config", None), "n_ctx_train", 0) or 0)


def whole_context(engine) -> int:
    """The max_tokens of "until the model stops or the context is full" (Ollama's num_predict -1, llama-server's
    n_predict -1): n_ctx, within the training context that max_tokens may not pass."""
    return min(engine.n_ctx, n_ctx_train(engine) or engine.n_ctx)


async def read_body(request: web.Request, then: Callable[[dict], Any] | None = None) -> Any:
    """The request's JSON body, read under --max-body and decoded from its Content-Encoding (413 past --max-body
    before or after; 400 for a body that cannot be read, decoded or parsed; 415 for a coding not supported), or
    then(body) (the route's validation: its ApiError as it raised it). A body of prepare.SMALL_BODY bytes or more is
    parsed and validated in the preparation pool, and marks the request's later preparation for it too."""
    cfg = request.app[CONFIG_KEY]
    body_coding.check_transfer_codings(request.headers.getall("Transfer-Encoding", []))
    applied = body_coding.codings(request.headers.getall("Content-Encoding", []))
    if request.content_length is not None and request.content_length > cfg.max_body:
        raise ApiError(413, f"the request body is {request.content_length} bytes, more than --max-body "
                            f"({cfg.max_body} bytes)", code="request_too_large")
    try:
        raw = await asyncio.wait_for(request.read(), cfg.body_timeout)
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within --body-timeout ({cfg.body_timeout:g} s)",
                       code="request_timeout", headers={"Connection": "close"}) from None
    except web.HTTPRequestEntityTooLarge:
        raise ApiError(413, f"the request body is larger than --max-body ({cfg.max_body} bytes)",
                       code="request_too_large") from None
    except web.RequestPayloadError as e:   # e.g. broken chunked framing
        why = malformed(e) or " ".join(str(e).split()).removeprefix("400, message: ")
        raise ApiError(400, f"the request body could not be read: {why}") from None
    if len(raw) >= prepare.SMALL_BODY or (applied and raw):    # a compressed body may inflate to --max-body
        prepare.mark_heavy(request)

    def parse():
        body = schema.parse_json(body_coding.decode(raw, applied, cfg.max_body))
        return then(body) if then is not None else body
    return await prepare.prepared(request, parse)


def as_api_error(err: EngineError) -> ApiError:
    """What an exception of the engine (or the worker) answers the client: 400 for a refused request, 503 while
    shutting down, the status an engine fault carries (a stage link down 503, a worker's bad result 502, NaN logits
    500), else 500."""
    e = err.exc
    if isinstance(e, ApiError):
        return e
    if isinstance(e, ShuttingDown):
        return ApiError(503, "the server is shutting down", code="shutting_down", headers={"Retry-After": "5"})
    name = type(e).__name__
    if isinstance(e, (Unavailable, EngineFault)):   # a stage link failure, a worker's bad result, NaN logits
        return ApiError(e.status, str(e), code=e.code)
    if isinstance(e, Refused):
        return refusal(e)
    if isinstance(e, ValueError):
        return ApiError(400, str(e), code="invalid_value")
    return ApiError(500, f"the engine failed: {name}: {e}", code="engine_error")


def submit(w: EngineWorker, what, *, call: bool = False, rid: str = "", stop=None, slot: int | None = None) -> Job:
    """Queue a GenerationRequest (or, call=True, a function of the engine, run once request slot `slot` is idle
    where one is named) on the worker; 503 when it is full or shutting down."""
    try:
        return w.call(what, rid, stop=stop, slot=slot) if call else w.submit(what, rid)
    except QueueFull as e:
        raise ApiError(503, f"the server is busy: {e}; retry later", code="queue_full",
                       headers={"Retry-After": str(1)}) from None
    except ShuttingDown:
        raise ApiError(503, "the server is shutting down", code="shutting_down",
                       headers={"Retry-After": "5"}) from None


async def engine_call(request: web.Request, fn, stop=None, slot: int | None = None):
    """fn(engine) run on the engine thread behind the requests before it (bounded by --queue-max: 503 when full),
    and once request slot `slot` is idle where one is named (a slot action waits for the request running there, as
    llama-server defers it); its result, or its exception as an ApiError. stop (a threading.Event fn watches): set
    when the handler is cancelled (the client went away)."""
    job = submit(request.app[WORKER_KEY], fn, call=True, rid=request.get("rid", ""), stop=stop, slot=slot)
    try:
        item = await job.events.get()
    except BaseException:
        request.app[WORKER_KEY].drop(job)
        raise
    if isinstance(item, EngineError):
        raise as_api_error(item)
    return item[1]


async def next_event(job: Job):
    """The job's next event; an EngineError in its place is raised as its ApiError."""
    item = await job.events.get()
    if isinstance(item, EngineError):
        raise as_api_error(item)
    return item
