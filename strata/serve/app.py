"""The aiohttp application: make_app puts together the middleware (middleware.py) and the routes of each API.

Routes: POST /v1/chat/completions, POST /v1/completions (JSON or SSE) from completions_api.py; GET /v1/models[/{id}],
GET /health, GET /metrics, GET /slots, POST /slots/{id}?action=save|restore|erase, GET /status, GET /cache from
admin_api.py; llama-server's /completion, /tokenize, /detokenize, /apply-template, /props from llama_api.py and
/infill from infill_api.py, the embedding routes of OpenAI, llama-server and Ollama (/v1/embeddings, /embedding,
/embeddings, /api/embed, /api/embeddings) from embeddings_api.py, OpenAI's /v1/responses from responses_api.py, Anthropic's /v1/messages from
messages_api.py (both through completions_api.generate_chat, the chat route's path), the web chat page (GET /,
/web/...) from chat_page.py.
Every error is an OpenAI error object ({"error": {"message", "type", "param", "code"}}), except on routes that
register their API's own shape in ERROR_SHAPES_KEY.
"""
from __future__ import annotations

import time

from aiohttp import web

from strata.serve import (admin_api, chat_page, completions_api, embeddings_api, infill_api, llama_api, messages_api,
                          ollama_api, prepare, responses_api)
from strata.serve.config import (CONFIG_KEY, ERROR_SHAPES_KEY, GUARD_KEY, METRICS_KEY, STARTED_KEY, WORKER_KEY,
                                 ServeConfig, format_hostport)
from strata.serve.browser import BrowserPolicy
from strata.serve.connections import ConnectionGuard
from strata.serve.metrics import Metrics
from strata.serve.middleware import middleware
from strata.serve.worker import EngineWorker

__all__ = ["ServeConfig", "format_hostport", "make_app"]      # ServeConfig, format_hostport: their old home


# this module's routes, in the order they are added (GET routes answer HEAD too, as aiohttp's add_get makes them)
ROUTES = (
    ("POST", "/v1/chat/completions", completions_api.chat_completions),
    ("POST", "/chat/completions", completions_api.chat_completions),
    ("POST", "/v1/completions", completions_api.completions),
    ("POST", "/completions", completions_api.completions),
    ("GET", "/v1/models", admin_api.models),
    ("GET", "/v1/models/{model}", admin_api.model_one),
    ("GET", "/health", admin_api.health),
    ("GET", "/v1/health", admin_api.health),
    ("GET", "/metrics", admin_api.metrics),
    ("GET", "/slots", admin_api.slots),
    ("POST", "/slots/{slot}", admin_api.slot_action),
    ("GET", "/status", admin_api.status),
    ("GET", "/cache", admin_api.cache),
)


def make_app(cfg: ServeConfig, worker: EngineWorker, metrics_: Metrics,
             guard: ConnectionGuard | None = None) -> web.Application:
    """Build the application; `worker` owns the engine thread (started by the caller); `guard` (the server's
    connection limits) learns which connections have a request in hand."""
    policy = BrowserPolicy(cfg.host, cfg.allowed_hosts, cfg.cors_origins, keyed=bool(cfg.api_key))
    app = web.Application(middlewares=([guard.middleware()] if guard else []) + [middleware, policy.middleware()],
                          client_max_size=cfg.max_body)
    app.on_response_prepare.append(policy.on_prepare)
    if guard is not None:
        for listener in ("unix", "tcp"):
            metrics_.connections.labels(listener=listener).set_function(
                lambda listener=listener: guard.counts().get(listener, 0))
    if guard is not None:
        app[GUARD_KEY] = guard
    app[CONFIG_KEY] = cfg
    app[WORKER_KEY] = worker
    app[METRICS_KEY] = metrics_
    app[STARTED_KEY] = time.time()
    app[ERROR_SHAPES_KEY] = {}
    prepare.add_pool(app, lambda: worker.queue_max + worker.slots)   # a request's preparation off the loop
    for method, path, handler in ROUTES:
        (app.router.add_get if method == "GET" else app.router.add_post)(path, handler)
    llama_api.add_routes(app)                   # llama-server's /tokenize, /detokenize, /apply-template, /props
    infill_api.add_routes(app)                  # llama-server's /infill
    chat_page.add_routes(app)
    responses_api.add_routes(app)               # OpenAI's /v1/responses
    messages_api.add_routes(app)                # Anthropic's /v1/messages
    ollama_api.add_routes(app)                  # Ollama's /api/chat, /api/generate, /api/tags, ...
    embeddings_api.add_routes(app)              # /v1/embeddings, llama-server's /embedding(s), Ollama's /api/embed
    return app
