"""The embedding routes of three APIs over Engine.embed: OpenAI's POST /v1/embeddings, llama-server's POST /embedding
and /embeddings (its non-OpenAI shape, every pooling including none), Ollama's POST /api/embed and the older
/api/embeddings. Inputs are read beside the live conversation (strata.engine.embed): a chat in progress keeps its
state and checkpoints. Errors take each API's own shape (registered by the llama and Ollama modules' shapes). The routes answer only on a
daemon started with --embeddings (llama-server's flag); without it, 501 naming the flag, before the body is read."""
from __future__ import annotations

import base64
import math
import threading
import time

import numpy as np
from aiohttp import web

from strata.engine.embed import MAX_INPUTS, POOLINGS, EmbedRefused, check_inputs, default_pooling
from strata.engine.types import ContextOverflow
from strata.serve import schema
from strata.serve.config import CONFIG_KEY, ERROR_SHAPES_KEY
from strata.serve.errors import ApiError
from strata.serve.fields import bad_field
from strata.serve.handling import engine_call, json_response, read_body, serving_engine
from strata.serve.prepare import prepared
from strata.serve.llama_api import llama_error
from strata.serve.ollama_api import check_options, ollama_error
from strata.text.tokenizer import check_text


def _is_id(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def read_inputs(v, field: str) -> list:
    """An `input` as its list of inputs, each a string or a list of token ids: a string, an array of token ids (one
    input), or an array of strings and arrays of token ids (several); 400 naming the field otherwise."""
    if isinstance(v, str):
        return [v]
    if not isinstance(v, list):
        raise bad_field(field, f"must be a string, an array of strings, an array of token ids or an array of arrays "
                               f"of token ids, got {schema._tname(v)}")
    if not v:
        raise bad_field(field, "must not be empty: there is nothing to embed")
    if all(_is_id(t) for t in v):
        return [list(v)]
    if len(v) > MAX_INPUTS:
        raise bad_field(field, f"has {len(v)} inputs, more than the {MAX_INPUTS} one request may embed")
    out = []
    for i, item in enumerate(v):
        if isinstance(item, str) or (isinstance(item, list) and all(_is_id(t) for t in item)):
            out.append(item)
        else:
            raise bad_field(f"{field}[{i}]", f"must be a string or an array of token ids, got {schema._tname(item)}")
    return out


def _tokens(engine, inputs: list, field: str, truncate: bool = False, num_ctx: int | None = None) -> list[list[int]]:
    """Each input as token ids: a string tokenized as llama-server's embeddings tokenize it (BOS / EOS per the
    model, special-token text read as those tokens), ids as they are; with truncate (Ollama's), only the first n_ctx
    tokens of a longer input. num_ctx (Ollama's option): a context shorter than --n-ctx for this request, inputs cut
    to it (truncate) or refused past it. 400 naming input[i] for an empty or too long input."""
    n_ctx = min(engine.n_ctx, num_ctx or engine.n_ctx)
    whose = "options.num_ctx" if n_ctx < engine.n_ctx else "--n-ctx"
    out = []
    for i, v in enumerate(inputs):
        at = field if len(inputs) == 1 else f"{field}[{i}]"
        if isinstance(v, str):
            if not v:
                raise bad_field(at, "is an empty string: there is nothing to embed")
            try:
                check_text(v)
                ids = list(engine.tokenizer.encode(v, parse_special=True)) if truncate else \
                    engine.tokenize_prompt(v)
            except ContextOverflow as e:
                raise bad_field(at, f"is too long: at least {e.n_prompt} tokens, more than the context of "
                                    f"{n_ctx} ({whose})", "context_length_exceeded") from None
            except ValueError as e:
                raise bad_field(at, f"is not valid text: {str(e).splitlines()[0][:200]}") from None
        else:
            ids = v
        if truncate:
            ids = ids[:n_ctx]
        elif n_ctx < engine.n_ctx and len(ids) > n_ctx:      # past --n-ctx: _checked's refusal
            raise bad_field(at, f"is too long: {len(ids)} tokens, more than the context of {n_ctx} ({whose})",
                            "context_length_exceeded")
        out.append(ids)
    return out


def _checked(engine, inputs: list[list[int]], field: str) -> None:
    """400 naming field[i] for an input the engine would refuse (empty, past the context, ids outside the vocabulary)
    -- the same check Engine.embed makes, here so that the message names the route's own field."""
    try:
        check_inputs(inputs, engine.n_ctx, engine.n_vocab)
    except EmbedRefused as e:
        msg, param = str(e), e.param or field
        if field != "input":
            msg, param = msg.replace("'input", f"'{field}", 1), param.replace("input", field, 1)
        raise ApiError(400, msg, param=param, code=e.code) from None


def _pooling(request: web.Request, body: dict) -> str | None:
    """The request's `pooling` (a Strata extension), else --pooling, else None (the model's)."""
    p = body.get("pooling")
    if p is not None and p not in POOLINGS:
        raise bad_field("pooling", f"must be one of {', '.join(POOLINGS)}")
    return p or request.app[CONFIG_KEY].pooling


def _normalize(body: dict, default: int = 2) -> int:
    """llama-server's embd_normalize: -1 none, 0 max absolute (int16 range), 1 taxicab, 2 Euclidean, > 2 p-norm."""
    v = body.get("embd_normalize", default)
    if not _is_id(v) or v < -1 or v > 64:
        raise bad_field("embd_normalize", "must be an integer: -1 (none), 0 (max absolute), 1 (taxicab), "
                                          "2 (Euclidean) or a p-norm up to 64")
    return v


def _dimensions(body: dict, engine) -> None:
    """`dimensions`: accepted when it is the model's own width; this model was not trained to give shorter vectors
    (OpenAI's text-embedding-3 were), so it refuses to cut them."""
    d = body.get("dimensions")
    if d is None:
        return
    n = int(engine.config.n_embd)
    if not _is_id(d) or d < 1:
        raise bad_field("dimensions", "must be a positive integer")
    if d != n:
        raise bad_field("dimensions", f"is {d}, but this model's embeddings have {n} dimensions and it was not "
                                      f"trained to give shorter ones: leave 'dimensions' out or send {n}",
                        "unsupported_value")


def _served(request: web.Request) -> None:
    """ApiError 501 unless the daemon was started with --embeddings."""
    if not request.app[CONFIG_KEY].embeddings:
        raise ApiError(501, "this server does not serve embeddings: start strata serve with --embeddings",
                       code="not_supported")


async def _embed(request: web.Request, inputs: list, field: str, pooling: str | None, norm: int,
                 truncate: bool = False, num_ctx: int | None = None):
    """Tokenize and embed on the engine thread -> (engine, [Embedding]); a client that goes away stops the read
    after its current forward call."""
    engine = serving_engine(request)
    stop = threading.Event()

    def run(eng):
        ids = _tokens(eng, inputs, field, truncate, num_ctx)
        _checked(eng, ids, field)
        return eng.embed(ids, pooling=pooling, normalize=norm, cancel=stop)
    return engine, await engine_call(request, run, stop=stop)


def _model_pooling(engine, pooling: str | None) -> str:
    return pooling or default_pooling(engine.file.metadata, engine.arch)


async def openai_embeddings(request: web.Request) -> web.Response:
    """POST /v1/embeddings {input, model, encoding_format=float|base64, dimensions, user; Strata's pooling,
    embd_normalize} -> {"object": "list", "data": [{"object": "embedding", "index", "embedding"}], "model", "usage"}."""
    _served(request)
    body = await read_body(request)
    engine = serving_engine(request)
    if "input" not in body:
        raise bad_field("input", "is required: the text (or token ids) to embed", "missing_required_parameter")
    inputs = await prepared(request, lambda: read_inputs(body["input"], "input"))
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_field("model", "must be a string")
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise bad_field("encoding_format", "must be \"float\" or \"base64\"")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise bad_field("user", "must be a string")
    _dimensions(body, engine)
    pooling = _pooling(request, body)
    if _model_pooling(engine, pooling) == "none":
        raise bad_field("pooling", "is none (one vector per token), which /v1/embeddings cannot carry: choose mean, "
                                   "cls or last, or use /embeddings")
    norm = _normalize(body)
    engine, out = await _embed(request, inputs, "input", pooling, norm)
    data = []
    for i, e in enumerate(out):
        v = e.vectors[0]
        emb = base64.b64encode(np.ascontiguousarray(v, dtype="<f4").tobytes()).decode() if fmt == "base64" \
            else v.tolist()
        data.append({"object": "embedding", "index": i, "embedding": emb})
    n = sum(e.n_tokens for e in out)
    return json_response({"object": "list", "data": data, "model": model or engine.model_name,
                          "usage": {"prompt_tokens": n, "total_tokens": n}})


async def llama_embeddings(request: web.Request) -> web.Response:
    """llama-server's POST /embedding and /embeddings {input | content, embd_normalize; Strata's pooling} ->
    [{"index", "embedding": [[...]]}]: the pooled vector, or with pooling none every token's (unnormalised)."""
    _served(request)
    body = await read_body(request)
    serving_engine(request)
    field = "input" if "input" in body else "content"
    if field not in body:
        raise bad_field("input", "or 'content' is required: the text (or token ids) to embed",
                        "missing_required_parameter")
    inputs = await prepared(request, lambda: read_inputs(body[field], field))
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise bad_field("encoding_format", "must be \"float\" or \"base64\"")
    pooling, norm = _pooling(request, body), _normalize(body)
    _, out = await _embed(request, inputs, field, pooling, norm)
    return json_response([{"index": i, "embedding": e.vectors.tolist()} for i, e in enumerate(out)])


def _ollama_fields(request: web.Request, body: dict, engine, route: str) -> tuple[str | None, int | None]:
    """Ollama's other fields -> (pooling, num_ctx): model a string; options checked as /api/chat checks them
    (ollama_api.check_options: unknown or mistyped ones refused, naming options.KEY), num_ctx a context for this
    request (a positive integer; at most --n-ctx is read), the rest without effect on an embedding (as in Ollama);
    Strata's `pooling` as on the other embedding routes, never none (one vector per token); keep_alive accepted
    (one model stays loaded)."""
    m = body.get("model")
    if m is not None and not isinstance(m, str):
        raise bad_field("model", "must be a string")
    num_ctx = check_options(body).get("num_ctx")
    if num_ctx is not None and not (num_ctx >= 1 and (isinstance(num_ctx, int) or math.isfinite(num_ctx)
                                                       and float(num_ctx).is_integer())):
        raise bad_field("options.num_ctx", f"must be a positive integer, got {num_ctx!r}")
    _dimensions(body, engine)
    pooling = _pooling(request, body)
    if _model_pooling(engine, pooling) == "none":
        why = "'pooling' is none" if body.get("pooling") else "--pooling is none"
        raise bad_field("pooling", f"{why} (one vector per token): {route} needs mean, cls or last")
    return pooling, None if num_ctx is None else int(num_ctx)


async def ollama_embed(request: web.Request) -> web.Response:
    """Ollama's POST /api/embed {model, input: str | [str], truncate=true, dimensions, options, keep_alive; Strata's
    pooling} ->
    {"model", "embeddings": [[...]], "total_duration", "load_duration", "prompt_eval_count"} (L2-normalised, as
    Ollama gives them; truncate: an input past the context is cut to its first n_ctx tokens, false refuses it)."""
    t0 = time.perf_counter_ns()
    _served(request)
    body = await read_body(request)
    engine = serving_engine(request)
    pooling, num_ctx = _ollama_fields(request, body, engine, "/api/embed")
    if "input" not in body:
        raise bad_field("input", "is required: the text to embed", "missing_required_parameter")
    inputs = await prepared(request, lambda: read_inputs(body["input"], "input"))
    truncate = body.get("truncate", True)
    if not isinstance(truncate, bool):
        raise bad_field("truncate", "must be a boolean")
    engine, out = await _embed(request, inputs, "input", pooling, 2, truncate=truncate, num_ctx=num_ctx)
    return json_response({"model": body.get("model") or engine.model_name,
                          "embeddings": [e.vectors[0].tolist() for e in out],
                          "total_duration": time.perf_counter_ns() - t0, "load_duration": 0,
                          "prompt_eval_count": sum(e.n_tokens for e in out)})


async def ollama_embeddings(request: web.Request) -> web.Response:
    """Ollama's older POST /api/embeddings {model, prompt, options, keep_alive; Strata's pooling} -> {"embedding":
    [...]} (not
    normalised, as Ollama gives it)."""
    _served(request)
    body = await read_body(request)
    engine = serving_engine(request)
    pooling, num_ctx = _ollama_fields(request, body, engine, "/api/embeddings")
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise bad_field("prompt", "is required: the text to embed, a string")
    engine, out = await _embed(request, [prompt], "prompt", pooling, -1, truncate=True, num_ctx=num_ctx)
    return json_response({"embedding": out[0].vectors[0].tolist()})


def add_routes(app: web.Application) -> None:
    """Register the routes and their error shapes on `app` (make_app calls this)."""
    r = app.router
    r.add_post("/v1/embeddings", openai_embeddings)
    for path in ("/embedding", "/embeddings"):
        app[ERROR_SHAPES_KEY][r.add_post(path, llama_embeddings).resource.canonical] = llama_error
    app[ERROR_SHAPES_KEY][r.add_post("/api/embed", ollama_embed).resource.canonical] = ollama_error
    app[ERROR_SHAPES_KEY][r.add_post("/api/embeddings", ollama_embeddings).resource.canonical] = ollama_error


__all__ = ["add_routes", "read_inputs"]
