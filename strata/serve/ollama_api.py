"""Ollama's API on the chat and completion routes' path: POST /api/chat and /api/generate (NDJSON streams, or one
JSON object with "stream": false), GET /api/tags, POST /api/show, GET /api/ps, GET /api/version; model management
(pull, push, create, copy, delete, blobs) refused in one line (/api/embed and /api/embeddings: embeddings_api.py). Errors are Ollama's: {"error": "..."}.

A request is translated into a chat request (options -> sampling fields, num_predict -> max_tokens, format ->
response_format, tool calls with object arguments -> the chat route's) and answered by completions_api, so
checkpoints, parking and constrained output work here as on every route. One model is loaded: any `model` name is
served by it.
"""
from __future__ import annotations

import json
import math
import os
import re
import time
from datetime import datetime, timezone

from aiohttp import web

from strata import __version__
from strata.engine.types import FinalEvent
from strata.gguf import identity
from strata.serve import schema
from strata.serve.answer_blocks import AnswerBlocks
from strata.serve.completions_api import generate_chat, generate_completion
from strata.serve.config import ERROR_SHAPES_KEY
from strata.serve.errors import ApiError, renamed
from strata.serve.fields import bad_field as _bad, unsupported_field as _unsupported
from strata.serve.handling import engine_of, json_response, next_event, read_body, served_names, whole_context
from strata.serve.prepare import prepared
from strata.structured.tool_calls import arguments_object

#: Ollama's options -> the chat route's fields (the same meaning)
OPTIONS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed",
           "repeat_penalty": "repeat_penalty", "repeat_last_n": "repeat_last_n",
           "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty", "stop": "stop"}
#: options that tune how Ollama loads or runs a model: the daemon's flags decide those here, so they are ignored
IGNORED_OPTIONS = frozenset({"num_ctx", "num_batch", "num_gpu", "main_gpu", "num_thread", "num_keep", "use_mmap",
                             "use_mlock", "numa", "low_vram", "f16_kv", "vocab_only", "logits_all", "embedding_only",
                             "typical_p", "tfs_z", "mirostat", "mirostat_tau", "mirostat_eta", "penalize_newline"})
#: the JSON type of each option above, as Ollama's api.Options declares it ("int" and "float" take any JSON number,
#: as Ollama's decoder does; "stop" a string or an array of strings)
OPTION_TYPES = {**{k: "int" for k in ("seed", "top_k", "repeat_last_n", "num_predict", "num_ctx", "num_batch",
                                      "num_gpu", "main_gpu", "num_thread", "num_keep", "mirostat")},
                **{k: "float" for k in ("temperature", "top_p", "min_p", "repeat_penalty", "presence_penalty",
                                        "frequency_penalty", "typical_p", "tfs_z", "mirostat_tau", "mirostat_eta")},
                **{k: "bool" for k in ("use_mmap", "use_mlock", "numa", "low_vram", "f16_kv", "vocab_only",
                                       "logits_all", "embedding_only", "penalize_newline")},
                "stop": "stop"}
MANAGEMENT = ("/api/pull", "/api/push", "/api/create", "/api/copy", "/api/delete")


def ollama_error(e: ApiError) -> dict:
    """An ApiError in Ollama's shape."""
    return {"error": e.message}


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _name(body: dict) -> str:
    m = body.get("model", body.get("name"))
    if m is not None and not isinstance(m, str):
        raise _bad("model", "must be a string")
    return m or "default"


def _max_tokens(num_predict, engine) -> int | None:
    """num_predict: None (the server's --n-predict), -1 / -2 (until the model stops or the context is full), or a
    count >= 0."""
    if num_predict is None:
        return None
    if isinstance(num_predict, bool) or not isinstance(num_predict, int) or num_predict < -2:
        raise _bad("options.num_predict", "must be an integer: a count, -1 (no limit) or -2 (fill the context)")
    return whole_context(engine) if num_predict < 0 else max(1, num_predict)


def check_options(body: dict) -> dict:
    """An Ollama body's `options` (absent or null: {}): an object of options Ollama has and Strata knows (OPTIONS,
    num_predict, IGNORED_OPTIONS), each of Ollama's JSON type (OPTION_TYPES; null: unset, as in Ollama); 400 naming
    options.KEY otherwise (Ollama only logs an option it does not know; a misspelt one here is refused rather than
    silently ignored)."""
    opts = body.get("options")
    if opts is None:
        return {}
    if not isinstance(opts, dict):
        raise _bad("options", "must be an object")
    for k, v in opts.items():
        kind = OPTION_TYPES.get(k)
        if kind is None:
            raise _unsupported(f"options.{k}", "is not an option Strata knows")
        if v is None:
            continue
        number = isinstance(v, (int, float)) and not isinstance(v, bool)
        if kind in ("int", "float") and not number or kind == "bool" and not isinstance(v, bool) or \
                kind == "stop" and not (isinstance(v, str) or isinstance(v, list) and all(isinstance(x, str)
                                                                                       for x in v)):
            want = {"int": "an integer", "float": "a number", "bool": "a boolean",
                    "stop": "a string or an array of strings"}[kind]
            raise _bad(f"options.{k}", f"must be {want}, got {schema._tname(v)}")
    return {k: v for k, v in opts.items() if v is not None}


def _fields(body: dict, engine) -> dict:
    """The chat route's fields of an Ollama body's options, format and stream."""
    opts = check_options(body)
    out: dict = {}
    for k, v in opts.items():
        if k in OPTIONS:
            out[OPTIONS[k]] = [v] if k == "stop" and isinstance(v, str) else v
    mt = _max_tokens(opts.get("num_predict"), engine)
    if mt is not None:
        out["max_tokens"] = mt
    fmt = body.get("format")
    if fmt == "json":
        out["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict):
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt,
                                                                         "strict": True}}
    elif fmt not in (None, ""):
        raise _bad("format", "must be \"json\" or a JSON schema object")
    stream = body.get("stream", True)
    if not isinstance(stream, bool):
        raise _bad("stream", "must be a boolean")
    out["stream"] = stream
    out["model"] = _name(body)
    return out


def _messages(msgs) -> list[dict]:
    """Ollama's messages as the chat route's: images refused, an assistant's tool calls with object arguments given
    ids and JSON strings, a tool message's tool_name as its name."""
    if not isinstance(msgs, list):
        raise _bad("messages", "must be an array of message objects")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}]", "must be an object")
        if m.get("images"):
            raise _unsupported(f"messages[{i}].images", "are not supported: the model reads text only")
        msg = {"role": m.get("role"), "content": m.get("content", "")}
        if m.get("tool_name") is not None:
            msg["name"] = m["tool_name"]
        calls = m.get("tool_calls")
        if calls is not None:
            if not isinstance(calls, list):
                raise _bad(f"messages[{i}].tool_calls", "must be an array of tool call objects")
            msg["tool_calls"] = []
            for j, c in enumerate(calls):
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict):
                    raise _bad(f"messages[{i}].tool_calls[{j}]", "must be an object with a 'function' object")
                args = fn.get("arguments", {})
                if schema.nesting(args) > schema.MAX_ARGUMENT_DEPTH:
                    raise _bad(f"messages[{i}].tool_calls[{j}].function.arguments",
                               f"nests deeper than {schema.MAX_ARGUMENT_DEPTH} levels")
                msg["tool_calls"].append({"id": f"call_{i}_{j}", "type": "function",
                                          "function": {"name": fn.get("name"),
                                                       "arguments": args if isinstance(args, str) else
                                                       json.dumps(args, ensure_ascii=False)}})
        out.append(msg)
    return out


#: the chat route's field names -> Ollama's: a refusal of a translated body names the field as the body has it
_RENAMES = [(re.compile(r"\bresponse_format(\.json_schema(\.schema)?)?"), "format"),
            (re.compile(r"\bmax_tokens\b"), "options.num_predict"),
            *((re.compile(rf"^{k}$|(?<='){k}(?=')"), f"options.{k}") for k in OPTIONS)]


def parse_chat(body: dict, engine) -> schema.ParsedRequest:
    """A /api/chat body as a chat request."""
    chat = {**_fields(body, engine), "messages": _messages(body.get("messages"))}
    if body.get("tools") is not None:
        chat["tools"] = body["tools"]
    return schema.parse_chat(chat)


def parse_generate(body: dict, engine) -> schema.ParsedRequest | None:
    """A /api/generate body as a chat request on the model's template (or, raw: true, a raw completion); None for
    an empty prompt (Ollama's way to load a model: nothing is generated)."""
    prompt = body.get("prompt", "")
    if not isinstance(prompt, str):
        raise _bad("prompt", "must be a string")
    for key, what in (("images", "the model reads text only"), ("suffix", "fill-in-the-middle is not served here"),
                      ("context", "send the conversation to /api/chat instead"),
                      ("template", "the model's own chat template is used")):
        if body.get(key):
            raise _unsupported(key, f"is not supported: {what}")
    raw = body.get("raw", False)
    if not isinstance(raw, bool):
        raise _bad("raw", "must be a boolean")
    system = body.get("system")
    if system is not None and not isinstance(system, str):
        raise _bad("system", "must be a string")
    if not prompt:
        return None
    fields = _fields(body, engine)
    if raw:
        if system:
            raise _bad("system", "has no place in a raw prompt")
        return schema.parse_completion({**fields, "prompt": prompt})
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    return schema.parse_chat({**fields, "messages": msgs})


class _Answer:
    """One answer as Ollama's objects: the chunks of a stream and the final object (with the durations in ns)."""

    def __init__(self, p: schema.ParsedRequest, t0: float, chat: bool):
        self.p, self.t0, self.chat = p, t0, chat
        self.content, self.thinking, self.calls = "", "", []
        self.final: FinalEvent | None = None
        self.finish: str | None = None

    def chunk(self, content: str = "", thinking: str = "", calls: list | None = None, done: bool = False) -> dict:
        d: dict = {"model": self.p.model or "default", "created_at": _now()}
        if self.chat:
            msg: dict = {"role": "assistant", "content": content}
            if thinking:
                msg["thinking"] = thinking
            if calls:
                msg["tool_calls"] = calls
            d["message"] = msg
        else:
            d["response"] = content
            if thinking:
                d["thinking"] = thinking
        d["done"] = done
        if done:
            f = self.final
            t = f.timings if f is not None else {}
            d.update({"done_reason": "length" if (self.finish or f.finish_reason) == "length" else "stop",
                      "total_duration": int((time.perf_counter() - self.t0) * 1e9), "load_duration": 0,
                      # Ollama's counts: the whole prompt, the cached tokens included, and those apart
                      "prompt_eval_count": int(f.usage.get("prompt_tokens", 0)) if f is not None else 0,
                      "prompt_eval_cached_count": int(t.get("cache_n", 0) or 0),
                      "prompt_eval_duration": int(float(t.get("prompt_ms", 0.0) or 0.0) * 1e6),
                      "eval_count": int(f.usage["completion_tokens"]) if f is not None else 0,
                      "eval_duration": int(float(t.get("predicted_ms", 0.0) or 0.0) * 1e6)})
        return d

    async def pieces(self, job, answer):
        """(content, thinking, calls) as they come: through the answer's blocks on the chat path, the tokens' text
        on a raw completion."""
        if answer is None:
            while True:
                ev = await next_event(job)
                if isinstance(ev, FinalEvent):
                    self.final = ev
                    if ev.text:
                        yield ev.text, "", None
                    return
                if ev.text:
                    yield ev.text, "", None
        ab = AnswerBlocks(answer)
        async for what, b, text in ab.events(job):
            if what == "delta" and b.kind == "text":
                yield text, "", None
            elif what == "delta" and b.kind == "reasoning":
                yield "", text, None
            elif what == "stop" and b.kind == "call":
                args = arguments_object(b.text)
                yield "", "", [{"function": {"name": b.name, "arguments": {} if args is None else args}}]
        self.final, self.finish = ab.final, ab.final.finish_reason


def _responder(t0: float, chat: bool):
    async def respond(request, engine, p, job, answers):
        a = _Answer(p, t0, chat)
        if not p.stream:
            async for content, thinking, calls in a.pieces(job, answers[0]):
                a.content, a.thinking = a.content + content, a.thinking + thinking
                a.calls += calls or []
            return json_response(a.chunk(a.content, a.thinking, a.calls, done=True))
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson", "X-Request-Id": request["rid"]})
        await resp.prepare(request)
        try:
            async for content, thinking, calls in a.pieces(job, answers[0]):
                await resp.write((json.dumps(a.chunk(content, thinking, calls), ensure_ascii=False) + "\n").encode())
            await resp.write((json.dumps(a.chunk(done=True), ensure_ascii=False) + "\n").encode())
        except ApiError as e:                 # after the stream began: one error line ends it
            await resp.write((json.dumps(ollama_error(e), ensure_ascii=False) + "\n").encode())
        await resp.write_eof()
        return resp
    return respond


# ------------------------------------------------------------------------------------------------ routes
async def chat(request: web.Request) -> web.StreamResponse:
    """POST /api/chat."""
    t0 = time.perf_counter()
    body = await read_body(request)
    if body.get("messages") in (None, []):             # Ollama's way to load a model: nothing is generated
        return json_response({"model": _name(body), "created_at": _now(),
                              "message": {"role": "assistant", "content": ""}, "done": True, "done_reason": "load"})
    try:
        engine = engine_of(request)
        p = await prepared(request, lambda: parse_chat(body, engine))
        return await generate_chat(request, p, respond=_responder(t0, chat=True))
    except ApiError as e:
        raise renamed(e, _RENAMES) from None


async def generate(request: web.Request) -> web.StreamResponse:
    """POST /api/generate."""
    t0 = time.perf_counter()
    body = await read_body(request)
    try:
        engine = engine_of(request)
        p = await prepared(request, lambda: parse_generate(body, engine))
        if p is None:
            return json_response({"model": _name(body), "created_at": _now(), "response": "", "done": True,
                                  "done_reason": "load"})
        if p.kind == "completion":
            return await generate_completion(request, p, respond=_responder(t0, chat=False))
        return await generate_chat(request, p, respond=_responder(t0, chat=False))
    except ApiError as e:
        raise renamed(e, _RENAMES) from None


def _details(engine) -> dict:
    f = engine.file
    quant = identity.quant_name(f)
    n_params = sum(math.prod(int(d) for d in t.shape) for t in f.tensors.values())
    return {"parent_model": "", "format": "gguf", "family": engine.arch, "families": [engine.arch],
            "parameter_size": _size_text(n_params), "quantization_level": quant}


def _size_text(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"


def _model_entry(engine, name: str) -> dict:
    path = engine.model_path
    return {"name": name, "model": name,
            "modified_at": datetime.fromtimestamp(os.path.getmtime(path), timezone.utc).isoformat(),
            "size": os.path.getsize(path), "digest": engine.file.fingerprint(), "details": _details(engine)}


async def tags(request: web.Request) -> web.Response:
    """GET /api/tags: the loaded model under each of its names."""
    engine = engine_of(request)
    return json_response({"models": [_model_entry(engine, n) for n in served_names(request, engine)]})


async def ps(request: web.Request) -> web.Response:
    """GET /api/ps: the loaded model (it stays loaded: no expiry)."""
    engine = engine_of(request)
    e = _model_entry(engine, engine.model_name)
    on_gpu = any(str(st.device).startswith("cuda") for st in engine.stages)
    e.update({"expires_at": "9999-12-31T23:59:59Z", "size_vram": e["size"] if on_gpu else 0})
    return json_response({"models": [e]})


async def show(request: web.Request) -> web.Response:
    """POST /api/show: the model's details, template and metadata (any name: one model is loaded)."""
    body = await read_body(request)
    engine = engine_of(request)
    _name(body)
    f = engine.file
    info = {k: v for k, v in f.metadata.items()
            if not k.startswith("tokenizer.") and isinstance(v, (str, int, float, bool))}
    template = f.metadata.get("tokenizer.chat_template") or ""
    caps = ["completion"] + (["tools"] if engine.template is not None and "tool" in template else [])
    entry = _model_entry(engine, engine.model_name)
    return json_response({"modelfile": f"FROM {engine.model_path}\n", "parameters": "", "template": template,
                          "details": entry["details"], "model_info": info, "capabilities": caps,
                          "modified_at": entry["modified_at"]})


async def version(request: web.Request) -> web.Response:
    """GET /api/version: Strata's version."""
    return json_response({"version": __version__})


async def management(request: web.Request) -> web.Response:
    """Model management: refused (one model, chosen when the daemon starts)."""
    raise ApiError(501, f"{request.path} is not supported: Strata serves the one model it was started with "
                        f"(--model); restart it with another to change models", code="not_implemented")


def add_routes(app: web.Application) -> None:
    """Register the routes and their error shape on `app` (make_app calls this)."""
    r = app.router
    routes = [r.add_post("/api/chat", chat), r.add_post("/api/generate", generate), r.add_get("/api/tags", tags),
              r.add_get("/api/ps", ps), r.add_post("/api/show", show), r.add_get("/api/version", version),
              ]
    routes += [r.add_route("*", path, management) for path in MANAGEMENT]
    routes += [r.add_route("*", "/api/blobs/{digest}", management)]
    for route in routes:
        app[ERROR_SHAPES_KEY][route.resource.canonical] = ollama_error
    app[ERROR_SHAPES_KEY]["/api/"] = ollama_error          # unknown routes under /api/ too
