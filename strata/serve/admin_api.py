"""The routes about the daemon rather than a generation: /health, /v1/models[/{id}], /metrics, /status, /cache,
/slots and POST /slots/{id}?action=save|restore|erase."""
from __future__ import annotations

import time

from aiohttp import web

from strata import __version__
from strata.serve.config import CONFIG_KEY, GUARD_KEY, METRICS_KEY, STARTED_KEY, WORKER_KEY
from strata.serve.errors import ApiError
from strata.serve.handling import (as_api_error, check_model, engine_call, engine_of, json_response, read_body,
                                   served_names)
from strata.serve.metrics import CONTENT_TYPE
from strata.serve.responses_api import STORE_KEY
from strata.serve.worker import EngineError

SLOT_ACTIONS = ("save", "restore", "erase")


async def health(request: web.Request) -> web.Response:
    w = request.app[WORKER_KEY]
    if w.engine is None:
        return json_response({"status": "loading" if w.load_error is None else "error"}, 503)
    why = w.engine.unavailable() if hasattr(w.engine, "unavailable") else None
    if why:
        return json_response({"status": "unavailable", "error": why}, 503)
    queue = {"running": w.n_running, "waiting": w.waiting, "max": w.queue_max}
    slots = {"slots_idle": w.slots - w.n_running, "slots_processing": w.n_running}     # llama-server's names
    stuck = w.stuck(request.app[CONFIG_KEY].stall_seconds)
    if stuck:
        return json_response({"status": "stuck", "error": stuck, "model": w.engine.model_name, "queue": queue,
                              **slots}, 503)
    return json_response({"status": "ok" if not w.closing else "stopping", "model": w.engine.model_name,
                          "queue": queue, **slots}, 200 if not w.closing else 503)


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
    disk = engine.disk.status() if engine is not None and engine.disk is not None else {}
    m.disk_tier_bytes.set(disk.get("bytes", 0))
    m.disk_tier_budget.set(disk.get("budget_bytes", 0))
    w = request.app[WORKER_KEY]
    m.slots = (w.slots, w.n_running, w.waiting, dict(engine.scheduler.stats)) if engine is not None else None
    if engine is not None:
        m.observe_session_files(engine.store.files.usage())
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
        "queue": {"running": w.n_running, "waiting": w.waiting, "max": w.queue_max, "slots": w.slots},
        "slots": _slots(engine, w),
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


def _slots(engine, w) -> list[dict]:
    """Every request slot as /slots shows it: llama-server's fields (id, id_task, n_ctx, is_processing,
    n_prompt_tokens, next_token) and Strata's (state, phase, pos, model, checkpoints: the kept ones on the path of
    the slot's conversation)."""
    views = engine.scheduler.status()
    n_ckpt = engine.slot_checkpoints()
    out = []
    for v in views:
        if w.slots == 1:         # a request alone runs outside the scheduler: the worker knows whether it runs
            job = w.running
            v = dict(v, is_processing=job is not None)
        out.append({**v, "n_ctx": engine.n_ctx, "state": "processing" if v["is_processing"] else "idle",
                    "model": engine.model_name, "checkpoints": n_ckpt[v["id"]]})
    return out


async def slots(request: web.Request) -> web.Response:
    """GET /slots; with llama-server's `fail_on_no_slot` (any non-empty value) a 503 when no slot is idle."""
    engine = engine_of(request)
    out = _slots(engine, request.app[WORKER_KEY])
    if request.query.get("fail_on_no_slot") and all(s["is_processing"] for s in out):
        raise ApiError(503, "no slot available", code="no_slot_available")
    return json_response(out)


async def slot_action(request: web.Request) -> web.Response:
    engine = engine_of(request)
    sid = request.match_info["slot"]
    if not (sid.isascii() and sid.isdigit()):      # str.isdigit alone takes '²' and other scripts' digits
        shown = repr(sid) if len(sid) <= 40 else repr(sid[:40])[:-1] + f"...' ({len(sid)} characters)"
        raise ApiError(400, f"slot id must be a non-negative integer, got {shown}", param="id", code="invalid_value")
    n = sid.lstrip("0") or "0"                    # int() of 4,301+ digits raises: compare the digits instead
    n_slots = int(getattr(engine, "parallel", 1))
    if len(n) > 6 or int(n) >= n_slots:
        shown = n if len(n) <= 20 else f"{n[:20]}... ({len(n)} digits)"
        has = "one slot (0)" if n_slots == 1 else f"{n_slots} slots (0..{n_slots - 1})"
        raise ApiError(404, f"slot {shown} does not exist: this daemon has {has}", param="id", code="not_found")
    slot = int(n)
    action = request.query.get("action")
    if len(request.query.getall("action", [])) > 1:       # which one was meant? (erase and save differ a lot)
        raise ApiError(400, f"the query parameter 'action' is given {len(request.query.getall('action'))} times: "
                       f"give it once", param="action", code="invalid_value")
    if action is None:
        raise ApiError(400, f"the query parameter 'action' is required: /slots/{slot}?action= one of "
                       f"{', '.join(SLOT_ACTIONS)}", param="action", code="invalid_value")
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
    if action != "erase":
        try:        # refusals that do not depend on the slot answer now, not once a busy slot is idle
            engine.check_slot_file(action, kw["filename"])
        except ValueError as e:         # Refused, SessionError
            raise as_api_error(EngineError(e)) from None
    result = await engine_call(request, lambda eng: fn(slot, **kw), slot=slot)
    return json_response(result if isinstance(result, dict) else {"id": slot, "action": action, "result": result})
