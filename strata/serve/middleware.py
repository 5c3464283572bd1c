"""The application's middleware: a request id on every log line, the API-key check on TCP, exceptions as error
objects in the shape of the route's API, the request metrics."""
from __future__ import annotations

import asyncio
import hmac
import re
import time
import uuid

import structlog
from aiohttp import web

from strata.engine.turn_clock import TurnClock
from strata.serve import chat_page
from strata.serve.config import CONFIG_KEY, ERROR_SHAPES_KEY, METRICS_KEY
from strata.errors import Refused
from strata.serve.errors import ApiError, refusal
from strata.serve.handling import is_unix, json_response

log = structlog.get_logger("strata.serve")

_RID_OK = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")


def _is_preflight(request: web.Request) -> bool:
    """A CORS preflight: browsers send it without credentials (strata.serve.browser answers it)."""
    return request.method == "OPTIONS" and "Origin" in request.headers \
        and "Access-Control-Request-Method" in request.headers


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


def _api_key_of(request: web.Request) -> bytes:
    """The key a client sent, as the bytes it sent: 'Authorization: Bearer <key>' (OpenAI's clients) or
    'x-api-key: <key>' (Anthropic's). Header bytes that are not UTF-8 reach here as surrogates: they are
    compared as bytes, so such a key is simply wrong."""
    got = request.headers.get("Authorization", "")
    key = got[7:] if got[:7].lower() == "bearer " else request.headers.get("x-api-key", "")
    return key.encode("utf-8", "surrogatepass")


#: paths that supervisors and scrapers poll: their answered GETs are logged at debug, not info (a health check every
#: second would fill the journal)
POLLED = frozenset({"/health", "/metrics"})


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
    request["clock"] = clock = TurnClock(t0)     # a generation's phases up to its first token (TurnClock)
    status = 500
    try:
        if cfg.api_key and request.path != "/health" and not chat_page.is_public(request.path) \
                and not is_unix(request) and not _is_preflight(request):
            if not hmac.compare_digest(_api_key_of(request), cfg.api_key.encode()):
                raise ApiError(401, "invalid or missing API key: send 'Authorization: Bearer <key>' or "
                                    "'x-api-key: <key>'", code="invalid_api_key",
                               headers={"WWW-Authenticate": "Bearer"})
        resp = await handler(request)
    except ApiError as e:
        resp = await _err_for(request, e)
    except Refused as e:
        resp = await _err_for(request, refusal(e))
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
    except ConnectionResetError as e:
        if not _client_gone(request):
            log.exception("request failed", error=f"{type(e).__name__}: {e}")
            resp = await _err_for(request, ApiError(500, f"internal error: {type(e).__name__}: {e}"))
        else:   # the client went away while its request was read or answered: no one to answer, nothing failed
            log.info("request cancelled", method=request.method, path=request.path,
                     ms=round((time.perf_counter() - t0) * 1e3, 2), reason=f"client disconnected ({e})")
            request.app[METRICS_KEY].requests.labels(route=await _route_name(request), status="499").inc()
            return web.Response(status=499)
    except Exception as e:  # noqa: BLE001 - nothing a client sends may crash the daemon
        log.exception("request failed", error=f"{type(e).__name__}: {e}")
        resp = await _err_for(request, ApiError(500, f"internal error: {type(e).__name__}: {e}"))
    status = resp.status
    if not resp.prepared:
        resp.headers["X-Request-Id"] = rid
    metrics = request.app[METRICS_KEY]
    metrics.requests.labels(route=await _route_name(request), status=str(status)).inc()
    turn = clock.report()                # a generation that reached its first token: where that time went
    if turn is not None:
        metrics.observe_turn(turn)
        log.info("request", method=request.method, path=request.path, status=status,
                 ms=round((time.perf_counter() - t0) * 1e3, 2), first_token_ms=turn["ms"],
                 outside_model_ms=turn["outside_model_ms"], phases_ms=turn["phases_ms"], other_ms=turn["other_ms"])
    else:
        quiet = status < 400 and request.path in POLLED and request.method in ("GET", "HEAD")
        (log.debug if quiet else log.info)("request", method=request.method, path=request.path, status=status,
                                           ms=round((time.perf_counter() - t0) * 1e3, 2))
    return resp


def _client_gone(request: web.Request) -> bool:
    """Whether the request's own connection is closed or closing (its client went away)."""
    t = request.transport
    return t is None or t.is_closing()


def _shape_for(shapes: dict, route: str, path: str):
    """The error shape of a route template, or for a path no route matched the shape of the longest prefix key
    (ending in '/') it starts with; None: OpenAI's."""
    if route != "unmatched":
        return shapes.get(route)
    prefixes = [p for p in shapes if p.endswith("/") and path.startswith(p)]
    return shapes[max(prefixes, key=len)] if prefixes else None


async def _err_for(request: web.Request, e: ApiError) -> web.Response:
    """The error response in the shape of the API the route belongs to (ERROR_SHAPES_KEY), else e's own."""
    shape = _shape_for(request.app[ERROR_SHAPES_KEY], await _route_name(request), request.path)
    return json_response(shape(e) if shape is not None else e.body(), e.status, e.headers)
