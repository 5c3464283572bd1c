"""The routes about the daemon rather than a generation: /health, /v1/models[/{id}], /metrics, /status, /cache,
/slots and POST /slots/{id}?action=save|restore|erase."""
from __future__ import annotations

import time

from aiohttp import web

from strata import __version__
from strata.serve.config import CONFIG_KEY, GUARD_KEY, METRICS_KEY, STARTED_KEY, WORKER_KEY
from strata.serve.errors import ApiError
from strata.serve.handling import check_model, engine_call, engine_of, json_response, read_body, served_names
from strata.serve.metrics import CONTENT_TYPE
from strata.serve.responses_api import STORE_KEY

SLOT_ACTIONS = ("save", "restore", "erase")


async def health(request: web.Request) -> web.Response:
    w = request.app[WORKER_KEY]
    if w.engine is None:
        return json_response({"status": "loading" if w.load_error is None else "error"}, 503)
    why = w.engine.unavailable() if hasattr(w.engine, "unavailable") else None
    if why:
        return json_response({"status": "unavailable", "error": why}, 503)
    queue = {"running": int(w.running is not None), "waiting": w.waiting, "max": w.queue_max}
    stuck = w.stuck(request.app[CONFIG_KEY].stall_seconds)
    if stuck:
        return json_response({"status": "stuck", "error": stuck, "model": w.engine.model_name, "queue": queue}, 503)
    return json_response({"status": "ok" if not w.closing else "stopping", "model": w.engine.model_name,
                          "queue": queue}, 200 if not w.closing else 503)


async def models(request: web.Request) -> web.Response:
    engine = engine_of(request)
    return json_response({"object": "list", "data": [_model_obj(request, engine, name)
                                                     for name in served_names(request, engine)]})


def _model_obj(request, engine, name: str) -> dict:
    return {"id": name, "object": "model", "created": int(request.app[STARTED_KEY]),
            "owned_by": "strata", "meta": {"n_ctx": engine.n_ctx, "arch": getattr(engine, "arch", None),
                                           "n_vocab": getattr(engine, "n_vocab", None),
                                           "path": getattr(engine, "model_path", None)}}


async def model_one(request: web.Request) -> web.Response:
    engine = engine_of(request)
    name = request.match_info["model"]
    check_model(request, engine, name)
    return json_response(_model_obj(request, engine, engine.model_name if name == "default" else name))


async def metrics(request: web.Request) -> web.Response:
    m = request.app[METRICS_KEY]
    engine = request.app[WORKER_KEY].engine
    m.moe_tiers = moe_tiers(engine) if engine is not None else []
    if engine is not None:
        m.observe_session_files(engine.store.session_files())
    return web.Response(body=m.render(), headers={"Content-Type": CONTENT_TYPE})


def moe_tiers(engine) -> list[tuple[int, dict]]:
    """(stage index, its expert tier's status) for each stage whose MoE layers run through the tier."""
    out = []
    for st in engine.stages:
        moe = getattr(getattr(st, "runner", None), "moe_path", None)
        if moe and "tier" in moe:
            out.append((st.index, moe["tier"]))
    return out


def _engine_status(engine) -> dict:
    for _ in range(3):  # read from the loop while the engine thread may be appending checkpoints
        try:
            return engine.status()
        except RuntimeError:
            continue
    return engine.status()


async def status(request: web.Request) -> web.Response:
    engine = engine_of(request)
    w = request.app[WORKER_KEY]
    cfg = request.app[CONFIG_KEY]
    st = _engine_status(engine)
    return json_response({
        "version": __version__, "model": engine.model_name, "uptime_s": round(time.time() - request.app[STARTED_KEY], 1),
        "stages": [{"stage": s["index"], "device": s["device"], "layers": [s["layer_lo"], s["layer_hi"]],
                    "remote": "link" in s, "runner": s["runner"], "memory": s["memory"],
                    **({"link": s["link"]} if "link" in s else {}), **({"moe": s["moe"]} if "moe" in s else {})}
                   for s in st.get("stages", [])],
        "queue": {"running": int(w.running is not None), "waiting": w.waiting, "max": w.queue_max},
        "listen": {"socket": cfg.socket_path, "tcp": cfg.tcp_address()},
        "connections": request.app[GUARD_KEY].status() if GUARD_KEY in request.app else None,
        "responses_store": request.app[STORE_KEY].stats() if STORE_KEY in request.app else None,
        "device": engine.device_info(),
        "engine": st,
    })


async def cache(request: web.Request) -> web.Response:
    engine = engine_of(request)
    st = _engine_status(engine)
    return json_response({"prompt_cache": st.get("prompt_cache"), "checkpoint_bytes": st.get("checkpoint_bytes"),
                          "pos": st.get("pos"), "checkpoints": st.get("checkpoints", []),
                          "parked": st.get("parked", []),
                          "conversation_cache_bytes": st.get("conversation_cache_bytes", 0)})


async def slots(request: web.Request) -> web.Response:
    engine = engine_of(request)
    w = request.app[WORKER_KEY]
    st = _engine_status(engine)
    return json_response([{"id": 0, "n_ctx": engine.n_ctx, "is_processing": w.running is not None,
                           "state": "processing" if w.running is not None else "idle", "pos": st.get("pos"),
                           "model": engine.model_name, "checkpoints": len(st.get("checkpoints", []))}])


async def slot_action(request: web.Request) -> web.Response:
    engine = engine_of(request)
    sid = request.match_info["slot"]
    if not (sid.isascii() and sid.isdigit()):      # str.isdigit alone takes '²' and other scripts' digits
        shown = repr(sid) if len(sid) <= 40 else repr(sid[:40])[:-1] + f"...' ({len(sid)} characters)"
        raise ApiError(400, f"slot id must be a non-negative integer, got {shown}", param="id", code="invalid_value")
    n = sid.lstrip("0") or "0"                    # int() of 4,301+ digits raises: compare the digits instead
    if n != "0":
        shown = n if len(n) <= 20 else f"{n[:20]}... ({len(n)} digits)"
        raise ApiError(404, f"slot {shown} does not exist: this daemon has one slot (0)", code="not_found")
    action = request.query.get("action")
    if action not in SLOT_ACTIONS:
        raise ApiError(400, f"'action' must be one of {', '.join(SLOT_ACTIONS)}, got {action!r}", param="action",
                       code="invalid_value")
    body = {}
    if request.can_read_body:
        body = await read_body(request)
    fn = getattr(engine, f"slot_{action}")
    # llama-server's request shape: {"filename": ...} for save / restore; anything else in the body is ignored
    kw = {"filename": body["filename"]} if action != "erase" and "filename" in body else {}
    if action != "erase" and not kw:
        raise ApiError(400, f"slot {action} needs a JSON body with \"filename\"", param="filename",
                       code="invalid_value")
    result = await engine_call(request, lambda eng: fn(0, **kw))
    return json_response(result if isinstance(result, dict) else {"id": 0, "action": action, "result": result})
