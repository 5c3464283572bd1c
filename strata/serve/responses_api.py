"""OpenAI's Responses API on the chat route's path: POST /v1/responses (JSON or SSE), GET and DELETE /v1/responses/{id}.

A request is translated into a chat request (input items -> messages, function tools -> chat tools, text.format ->
response_format) and answered by completions_api.generate_chat; the answer's blocks (strata.serve.answer_blocks) become
output items: `reasoning`, `message` (output_text) and `function_call`. Responses are kept (unless `store` is false) in
a bounded in-memory store, least recently used dropped first, for `previous_response_id`: the conversation so far is
sent again through the template, so the engine resumes from its live sequence or a checkpoint. Errors are OpenAI error
objects, with the Responses API's field names.
"""
from __future__ import annotations

import functools
import json
import re
import sys
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field

from aiohttp import web

from strata.errors import quoted
from strata.sampling.sampler import SamplingParams
from strata.serve import prepare, schema
from strata.serve.answer_blocks import AnswerBlocks, Block
from strata.serve.completions_api import generate_chat, strata_of, timings_of
from strata.serve.config import CONFIG_KEY, METRICS_KEY
from strata.serve.errors import ApiError, renamed
from strata.serve.fields import bad_field as _bad, each_object, text_of, unsupported_field as _unsupported
from strata.serve.handling import json_response, read_body
from strata.serve.sse import send_events

INPUT_ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text", "text")
ITEM_PREFIX = {"reasoning": "rs", "text": "msg", "call": "fc"}


def held_bytes(obj) -> int:
    """The memory a parsed JSON value holds: the sizes of its dicts, lists, strings and numbers (strings and
    numbers it shares with other values counted again, so it errs high)."""
    n, todo = 0, [obj]
    while todo:
        o = todo.pop()
        n += sys.getsizeof(o)
        if isinstance(o, dict):
            todo.extend(o.keys())
            todo.extend(o.values())
        elif isinstance(o, list):
            todo.extend(o)
    return n


class Turn:
    """The messages one stored response added to its conversation (the request's input and the answer), after
    the turn of the response it continued (`parent`, None for a first turn). A conversation is the chain of its
    turns, so each message is held once however many responses of the chain are kept."""
    __slots__ = ("parent", "messages", "cost", "refs")

    def __init__(self, parent: Turn | None, messages: list[dict]):
        self.parent, self.messages = parent, messages
        self.cost = held_bytes(messages) + sys.getsizeof(self)
        self.refs = 0

    def conversation(self) -> list[dict]:
        """Every message of the chain, the first turn's first."""
        turns, t = [], self
        while t is not None:
            turns.append(t.messages)
            t = t.parent
        return [m for ms in reversed(turns) for m in ms]


class ResponseStore:
    """Responses kept for previous_response_id and GET: id -> (the response object, its Turn). At most `size` of
    them (0: none) and `budget` bytes of what they hold (the response objects and every turn a kept response's
    chain reaches, each counted once), the least recently used (created, read, or continued through
    previous_response_id) dropped first. A turn lives while a kept response (or a later turn) refers to it: dropping
    a response never cuts its children's conversations short, and a response dropped is a 404 to continue."""

    ENTRY_COST = 200                               # the index's own bytes per entry: key, tuple, ordered-dict slot

    def __init__(self, size: int, budget: int = 256 << 20):
        self.size, self.budget = size, budget
        self._d: OrderedDict[str, tuple[dict, Turn, int]] = OrderedDict()
        self.nbytes = 0

    def _hold(self, t: Turn | None) -> None:
        while t is not None:
            t.refs += 1
            if t.refs > 1:
                return
            self.nbytes += t.cost                  # newly held: it holds its parent in turn
            t = t.parent

    def _release(self, t: Turn | None) -> None:
        while t is not None:
            t.refs -= 1
            if t.refs > 0:
                return
            self.nbytes -= t.cost
            t = t.parent

    def put(self, rid: str, response: dict, messages: list[dict], parent: Turn | None = None) -> None:
        """Keep `response`, whose conversation is parent's followed by `messages` (the ones it added)."""
        if self.size <= 0:
            return
        self.delete(rid)
        turn = Turn(parent, messages)
        cost = held_bytes(response) + len(rid) + self.ENTRY_COST
        self._hold(turn)
        self.nbytes += cost
        self._d[rid] = (response, turn, cost)
        while self._d and (len(self._d) > self.size or self.nbytes > self.budget):
            self._drop(next(iter(self._d)))

    def _drop(self, rid: str) -> None:
        _response, turn, cost = self._d.pop(rid)
        self.nbytes -= cost
        self._release(turn)

    def stats(self) -> dict:
        return {"entries": len(self._d), "bytes": self.nbytes, "budget": self.budget, "max_entries": self.size}

    def get(self, rid: str, touch: bool = True) -> tuple[dict, Turn] | None:
        """The response of rid and its turn (Turn.conversation: the messages after it), or None; touch: count this
        as a use (a request that fails validation does not)."""
        entry = self._d.get(rid)
        if entry is not None and touch:
            self._d.move_to_end(rid)
        return entry[:2] if entry is not None else None

    def delete(self, rid: str) -> bool:
        if rid not in self._d:
            return False
        self._drop(rid)
        return True

    def __len__(self) -> int:
        return len(self._d)


STORE_KEY = web.AppKey("responses_store", ResponseStore)
METADATA_KEYS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512     # OpenAI's limits


def _metadata(md) -> dict | None:
    """`metadata` as OpenAI takes it: at most 16 string keys of 64 characters, string values of 512, all valid
    Unicode."""
    if md is None:
        return None
    if not isinstance(md, dict):
        raise _bad("metadata", f"must be an object, got {schema._tname(md)}")
    schema.unicode_json(md, "metadata")                # first: the messages below quote the keys
    if len(md) > METADATA_KEYS:
        raise _bad("metadata", f"has {len(md)} keys, at most {METADATA_KEYS} are allowed")
    for k, v in md.items():
        if len(k) > METADATA_KEY_CHARS:
            raise _bad("metadata", f"has a key of {len(k)} characters, at most {METADATA_KEY_CHARS} are allowed")
        if not isinstance(v, str):
            raise _bad(f"metadata.{k[:METADATA_KEY_CHARS]}", f"must be a string, got {schema._tname(v)}")
        if len(v) > METADATA_VALUE_CHARS:
            raise _bad(f"metadata.{k}", f"has {len(v)} characters, at most {METADATA_VALUE_CHARS} are allowed")
    return dict(md)


def _not_found(rid: str, param: str | None = None) -> ApiError:
    return ApiError(404, f"response '{quoted(rid, 80)}' not found: it was never stored (store false), was deleted, "
                         f"or was dropped from the store (--responses-store and --responses-store-mib keep the most "
                         f"recent)", param=param,
                    code="previous_response_not_found" if param else "not_found")


# ------------------------------------------------------------------------------------------------ the request
@dataclass
class ResponsesRequest:
    """A validated /v1/responses body: the chat request it becomes, the conversation to keep after the answer
    (instructions excluded, as OpenAI does not carry them over), and what the response object echoes."""
    p: schema.ParsedRequest
    history: list[dict]
    store: bool
    echo: dict = field(default_factory=dict)
    #: the chat route's name of each tool call's arguments from this request's input -> the input item's
    arguments_at: dict[str, str] = field(default_factory=dict)
    #: the turn of the response this one continues (None: a new conversation) and this request's input messages
    parent: Turn | None = None
    new: list[dict] = field(default_factory=list)


def _text(content, where: str) -> str:
    """A message's or an output's content: a string, or an array of text parts (input_text / output_text)."""
    return text_of(content, where, types=TEXT_PARTS, array_of="input_text parts", type_at="",
                   refused=lambda t: f"has type {t!r}: Strata reads text parts only ({', '.join(TEXT_PARTS[:2])})")


def _str_field(item: dict, key: str, where: str) -> str:
    v = item.get(key)
    if not isinstance(v, str):
        raise _bad(f"{where}.{key}", f"must be a string, got {schema._tname(v)}")
    return v


def input_messages(inp, calls_at: dict | None = None) -> list[dict]:
    """'input' as chat messages: a string is one user message; message items keep their role (developer reads as
    system); function_call items join the assistant message before them (or make one) as tool_calls;
    function_call_output items become tool messages; reasoning items are left out (templates drop earlier turns'
    reasoning). calls_at, if given, gets (message index, call index) -> the function_call item's name."""
    if isinstance(inp, str):
        return [{"role": "user", "content": inp}]
    if not isinstance(inp, list) or not inp:
        raise _bad("input", "must be a string or a non-empty array of input items")
    out: list[dict] = []
    for where, item in each_object(inp, "input"):
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in INPUT_ROLES:
                raise _bad(f"{where}.role", f"must be one of {', '.join(INPUT_ROLES)}, got {role!r}")
            out.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call = {"id": _str_field(item, "call_id", where), "type": "function",
                    "function": {"name": _str_field(item, "name", where),
                                 "arguments": _str_field(item, "arguments", where)}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
            if calls_at is not None:
                calls_at[(len(out) - 1, len(out[-1]["tool_calls"]) - 1)] = where
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": _str_field(item, "call_id", where),
                        "content": _text(item.get("output"), f"{where}.output")})
        elif kind == "reasoning":
            continue
        else:
            raise _unsupported(f"{where}.type", f"is {kind!r}: Strata takes message, function_call, "
                                                "function_call_output and reasoning items")
    if not out:
        raise _bad("input", "holds no message: reasoning items alone give the model nothing to answer")
    return out


def _tools(tools) -> list[dict] | None:
    """Responses function tools ({"type": "function", "name", "description", "parameters", "strict"}) in the chat
    shape; other tool types (web_search, file_search, ...) are not Strata's to run."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _bad("tools", f"must be an array of tool objects, got {schema._tname(tools)}")
    out = []
    for at, t in each_object(tools, "tools"):
        if t.get("type") != "function":
            raise _unsupported(f"{at}.type", f"is {t.get('type')!r}: Strata runs function tools only")
        out.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters", "strict")
                                                     if k in t}})
    return out


def _tool_choice(tc):
    if tc is None or isinstance(tc, str):
        return tc                                  # "none" | "auto" | "required" (anything else: parse_chat's 400)
    if isinstance(tc, dict) and tc.get("type") == "function":
        return {"type": "function", "function": {"name": tc.get("name")}}
    raise _unsupported("tool_choice", 'must be "none", "auto", "required", {"type": "function", "name": ...} or '
                                      '{"type": "allowed_tools", ...}')


def _text_format(text):
    """'text': {"format": {"type": "text" | "json_object" | "json_schema", "name", "schema", "strict"}} -> the chat
    route's response_format."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise _bad("text", f"must be an object, got {schema._tname(text)}")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise _bad("text.format", f"must be an object, got {schema._tname(fmt)}")
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    return fmt


def parse(body: dict, store: ResponseStore) -> ResponsesRequest:
    """Validate a /v1/responses body and translate it into a chat request; the previous response's conversation
    comes first (404 when it is not in the store)."""
    if "input" not in body or body["input"] is None:
        raise ApiError(400, "'input' is required", param="input", code="missing_required_parameter")
    calls_at: dict[tuple[int, int], str] = {}
    new = input_messages(body["input"], calls_at)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise _bad("instructions", f"must be a string, got {schema._tname(instructions)}")
    prev_id = body.get("previous_response_id")
    history: list[dict] = []
    parent = None
    if prev_id is not None:
        if not isinstance(prev_id, str):
            raise _bad("previous_response_id", f"must be a string, got {schema._tname(prev_id)}")
        if not prev_id:
            raise _bad("previous_response_id", "must be a response id (resp_...), got an empty string")
        entry = store.get(prev_id, touch=False)        # used once the answer is done (bad input changes nothing)
        if entry is None:
            raise _not_found(prev_id, "previous_response_id")
        parent = entry[1]
        history = parent.conversation()
    history = history + new
    keep = schema._opt_bool(body, "store", True)
    max_out = schema._opt_int(body, "max_output_tokens", 1)
    if body.get("truncation") not in (None, "disabled"):
        raise _unsupported("truncation", f"is {body['truncation']!r}: Strata does not drop input to fit the context "
                                         "(\"disabled\" only)")
    metadata = _metadata(body.get("metadata"))
    for key in ("tools", "tool_choice", "text"):                    # echoed in the response as they came
        schema.unicode_json(body.get(key), key)
    tools, tool_choice = _tools(body.get("tools")), body.get("tool_choice")
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "allowed_tools":    # flat: {"type", "mode", "tools"}
        tools, tool_choice = schema.allowed_tools(tool_choice, tools, at="tool_choice", flat=True)
    else:
        tool_choice = _tool_choice(tool_choice)
    chat = {"model": body.get("model"), "stream": body.get("stream"), "max_tokens": max_out,
            "messages": ([{"role": "system", "content": instructions}] if instructions is not None else []) + history,
            "tools": tools, "tool_choice": tool_choice,
            "parallel_tool_calls": body.get("parallel_tool_calls"), "response_format": _text_format(body.get("text")),
            "temperature": body.get("temperature"), "top_p": body.get("top_p")}
    chat.update({k: body[k] for k in schema.EXTENSION_FIELDS if k in body})
    p = schema.parse_chat({k: v for k, v in chat.items() if v is not None})
    echo = {"instructions": instructions, "max_output_tokens": max_out, "previous_response_id": prev_id,
            "metadata": metadata or {}, "tools": body.get("tools") or [],
            "tool_choice": body.get("tool_choice") or "auto",
            "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}},
            "parallel_tool_calls": p.parallel_tool_calls, "store": keep}
    before = len(history) - len(new) + (instructions is not None)        # messages ahead of this request's input
    arguments_at = {f"messages[{i + before}].tool_calls[{j}].function.arguments": f"{where}.arguments"
                    for (i, j), where in calls_at.items()}
    return ResponsesRequest(p, history, keep, echo, arguments_at, parent, new)


# chat-route field names in errors -> the Responses API's
_RENAMES = [(re.compile(r"\btools\[(\d+)\]\.function\."), r"tools[\1]."),
            (re.compile(r"\bresponse_format(\.json_schema)?"), "text.format"),
            (re.compile(r"\bmax_tokens\b"), "max_output_tokens"),
            (re.compile(r"\bmessages\b"), "input")]


def _renamed(e: ApiError, arguments_at: dict[str, str] | None = None) -> ApiError:
    """e in the Responses API's names; arguments_at (ResponsesRequest.arguments_at) names a call's arguments as the
    input item that holds them."""
    for chat_name, item in (arguments_at or {}).items():
        if e.param == chat_name:
            e = ApiError(e.status, e.message.replace(chat_name, item), param=item, code=e.code, headers=e.headers)
    return renamed(e, _RENAMES)


# ------------------------------------------------------------------------------------------------ the answer
class _Response:
    """One response being answered: its ids, the items its blocks become, the response object at each stage."""

    def __init__(self, req: ResponsesRequest, engine, ab: AnswerBlocks, store: ResponseStore):
        self.req, self.engine, self.ab, self.store = req, engine, ab, store
        self.id = "resp_" + uuid.uuid4().hex
        self.created_at = int(time.time())
        self._item_ids: dict[int, str] = {}
        self.seq = 0

    def item_id(self, b: Block) -> str:
        if b.index not in self._item_ids:
            self._item_ids[b.index] = f"{ITEM_PREFIX[b.kind]}_{uuid.uuid4().hex}"
        return self._item_ids[b.index]

    def item(self, b: Block, done: bool) -> dict:
        """Block b as an output item: in progress and empty (output_item.added), or whole (done)."""
        ab = self.ab
        cut = ab.final is not None and ab.final.finish_reason == "length" and b is ab.blocks[-1]
        status = ("incomplete" if cut else "completed") if done else "in_progress"
        text = b.text if done else ""
        if b.kind == "call":
            return {"type": "function_call", "id": self.item_id(b), "call_id": b.call_id, "name": b.name,
                    "arguments": text, "status": status}
        if b.kind == "reasoning":
            return {"type": "reasoning", "id": self.item_id(b), "summary": [],
                    "content": [self.part(b, text)] if done else [], "status": status}
        return {"type": "message", "id": self.item_id(b), "status": status, "role": "assistant",
                "content": [self.part(b, text)] if done else []}

    @staticmethod
    def part(b: Block, text: str) -> dict:
        if b.kind == "reasoning":
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def obj(self, status: str, error: dict | None = None) -> dict:
        """The response object; with the answer's output, usage and Strata's timings and strata once it is done."""
        p, ab = self.req.p, self.ab
        d = {"id": self.id, "object": "response", "created_at": self.created_at, "status": status, "error": error,
             "incomplete_details": None, "model": self.engine.model_name, "output": [],
             "reasoning": {"effort": None, "summary": None}, "truncation": "disabled",
             "temperature": p.sampling.get("temperature", SamplingParams.temperature),
             "top_p": p.sampling.get("top_p", SamplingParams.top_p), "usage": None, **self.req.echo}
        if status in ("completed", "incomplete"):
            f = ab.final
            u = f.usage
            d["output"] = [self.item(b, True) for b in ab.blocks]
            d["usage"] = {"input_tokens": u["prompt_tokens"],
                          "input_tokens_details": {"cached_tokens": int(f.timings.get("cache_n", 0) or 0)},
                          "output_tokens": u["completion_tokens"],
                          "output_tokens_details": {"reasoning_tokens": ab.reasoning_tokens},
                          "total_tokens": u["total_tokens"]}
            d["timings"], d["strata"] = timings_of(f), strata_of(f)
            if status == "incomplete":
                d["incomplete_details"] = {"reason": "max_output_tokens"}
        return d

    def done(self) -> dict:
        """The finished response object, kept in the store (unless store is false) with the conversation after it."""
        ab = self.ab
        status = "incomplete" if ab.final.finish_reason == "length" else "completed"
        d = self.obj(status)
        if self.req.echo["previous_response_id"] is not None:
            self.store.get(self.req.echo["previous_response_id"])
        if self.req.store:
            calls = [{"id": b.call_id, "type": "function", "function": {"name": b.name, "arguments": b.text}}
                     for b in ab.blocks if b.kind == "call"]
            msg = {"role": "assistant", "content": ab.text()}
            if calls:
                msg["tool_calls"] = calls
            self.store.put(self.id, d, self.req.new + [msg], self.req.parent)
        return d

    def event(self, kind: str, **data) -> tuple[str, dict]:
        ev = {"type": kind, "sequence_number": self.seq, **data}
        self.seq += 1
        return kind, ev

    async def stream(self, job):
        """The Responses SSE events: response.created and response.in_progress, each block's item (added, its
        content part, deltas, done), then response.completed (or response.incomplete: cut by max_output_tokens)."""
        started = False
        async for what, b, text in self.ab.events(job):
            if not started:
                started = True
                yield self.event("response.created", response=self.obj("in_progress"))
                yield self.event("response.in_progress", response=self.obj("in_progress"))
            for ev in self._block_events(what, b, text):
                yield ev
        if not started:
            yield self.event("response.created", response=self.obj("in_progress"))
            yield self.event("response.in_progress", response=self.obj("in_progress"))
        d = self.done()
        yield self.event(f"response.{d['status']}", response=d)

    def _block_events(self, what: str, b: Block, text: str):
        at = {"item_id": self.item_id(b), "output_index": b.index}
        kind = {"text": "output_text", "reasoning": "reasoning_text"}.get(b.kind)
        if what == "start":
            yield self.event("response.output_item.added", output_index=b.index, item=self.item(b, False))
            if kind:
                yield self.event("response.content_part.added", **at, content_index=0, part=self.part(b, ""))
        elif what == "delta":
            if b.kind == "call":
                yield self.event("response.function_call_arguments.delta", **at, delta=text)
            elif b.kind == "text":
                yield self.event("response.output_text.delta", **at, content_index=0, delta=text, logprobs=[])
            else:
                yield self.event("response.reasoning_text.delta", **at, content_index=0, delta=text)
        else:
            if b.kind == "call":
                yield self.event("response.function_call_arguments.done", **at, name=b.name, arguments=b.text)
            else:
                extra = {"logprobs": []} if b.kind == "text" else {}
                yield self.event(f"response.{kind}.done", **at, content_index=0, text=b.text, **extra)
                yield self.event("response.content_part.done", **at, content_index=0, part=self.part(b, b.text))
            yield self.event("response.output_item.done", output_index=b.index, item=self.item(b, True))

    def failed(self, e: ApiError) -> list[tuple[str, dict]]:
        """The end of a stream an error cut: an `error` event, then response.failed."""
        e = _renamed(e)
        code = e.code or "server_error"
        return [self.event("error", code=code, message=e.message, param=e.param),
                self.event("response.failed", response=self.obj("failed", {"code": code, "message": e.message}))]


async def _respond(req: ResponsesRequest, store: ResponseStore, request, engine, p, job, answers):
    r = _Response(req, engine, AnswerBlocks(answers[0]), store)
    if p.stream:
        return await send_events(request, job, r.stream(job), r.failed)
    async for _ in r.ab.events(job):
        pass
    return json_response(r.done())


# ------------------------------------------------------------------------------------------------ routes
async def create_response(request: web.Request) -> web.StreamResponse:
    """POST /v1/responses."""
    body = await read_body(request)
    store = request.app[STORE_KEY]
    req = None
    try:
        if body.get("previous_response_id") is not None:
            prepare.mark_heavy(request)    # the stored conversation is validated and rendered again with the input
        req = await prepare.prepared(request, lambda: parse(body, store))
        return await generate_chat(request, req.p, respond=functools.partial(_respond, req, store))
    except ApiError as e:
        raise _renamed(e, req.arguments_at if req is not None else None) from None


async def get_response(request: web.Request) -> web.Response:
    """GET /v1/responses/{id}: a kept response."""
    rid = request.match_info["id"]
    entry = request.app[STORE_KEY].get(rid)
    if entry is None:
        raise _not_found(rid)
    return json_response(entry[0])


async def delete_response(request: web.Request) -> web.Response:
    """DELETE /v1/responses/{id}: drop a kept response (a later previous_response_id naming it is a 404)."""
    rid = request.match_info["id"]
    if not request.app[STORE_KEY].delete(rid):
        raise _not_found(rid)
    return json_response({"id": rid, "object": "response", "deleted": True})


def add_routes(app: web.Application) -> None:
    """Register the routes and the store (its size from --responses-store and --responses-store-mib) on `app`
    (make_app calls this)."""
    store = app[STORE_KEY] = ResponseStore(app[CONFIG_KEY].responses_store, app[CONFIG_KEY].responses_store_mib << 20)
    app[METRICS_KEY].responses_store_bytes.set_function(lambda: store.nbytes)
    r = app.router
    r.add_post("/v1/responses", create_response)
    r.add_get("/v1/responses/{id}", get_response)
    r.add_delete("/v1/responses/{id}", delete_response)
