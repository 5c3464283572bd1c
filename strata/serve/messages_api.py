"""Anthropic's Messages API on the chat route's path: POST /v1/messages (JSON or SSE), POST /v1/messages/count_tokens.

A request is translated into a chat request (system and content blocks -> messages, tool_use blocks -> tool_calls,
tool_result blocks -> tool messages, tools' input_schema -> parameters, tool_choice auto / any / tool / none,
output_config.format -> response_format) and answered by completions_api.generate_chat; the answer's blocks
(strata.serve.answer_blocks) become `thinking`, `text` and `tool_use` content blocks. Errors, on these routes the
middleware's too (a bad key, an unknown method), are Anthropic's: {"type": "error", "error": {"type", "message"}}.
"""
from __future__ import annotations

import json
import re
import uuid

from aiohttp import web

from strata.serve import schema
from strata.serve.answer_blocks import AnswerBlocks, Block
from strata.serve.completions_api import generate_chat, render_chat, strata_of, timings_of
from strata.serve.config import ERROR_SHAPES_KEY
from strata.serve.errors import ApiError, renamed
from strata.serve.fields import bad_field as _bad, each_object, part_text, text_of, unsupported_field as _unsupported
from strata.serve.handling import json_response, read_body
from strata.serve.prepare import prepared
from strata.serve.sse import send_events
from strata.structured.tool_calls import arguments_object

# HTTP status -> Anthropic's error type (https://docs.anthropic.com/en/api/errors)
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
               415: "invalid_request_error", 429: "rate_limit_error", 500: "api_error", 501: "api_error",
               502: "api_error", 503: "overloaded_error"}
TOOL_CHOICES = ("auto", "any", "tool", "none")


def anthropic_error(e: ApiError) -> dict:
    """An ApiError in Anthropic's shape."""
    return {"type": "error", "error": {"type": ERROR_TYPES.get(e.status, "api_error"), "message": e.message}}


def _text_blocks(content, where: str) -> str:
    """A string, or an array of text blocks, as one text."""
    return text_of(content, where, types=("text",), array_of="text blocks", type_at=".type",
                   refused=lambda t: f"is {t!r}: only text blocks are read here")


def _user_messages(content: list, where: str) -> list[dict]:
    """A user turn's blocks as chat messages: each tool_result a tool message, each run of text blocks a user
    message, in their order."""
    out: list[dict] = []
    for at, b in each_object(content, where):
        t = b.get("type")
        if t == "text":
            text = part_text(b, at)
            if out and out[-1]["role"] == "user":
                out[-1]["content"] += text
            else:
                out.append({"role": "user", "content": text})
        elif t == "tool_result":
            if not isinstance(b.get("tool_use_id"), str):
                raise _bad(f"{at}.tool_use_id", "must be a string")
            out.append({"role": "tool", "tool_call_id": b["tool_use_id"],
                        "content": _text_blocks(b.get("content", ""), f"{at}.content")})
        else:
            raise _unsupported(f"{at}.type", f"is {t!r}: a user turn's blocks Strata reads are text and tool_result")
    return out


def _assistant_message(content: list, where: str) -> dict:
    """An assistant turn's blocks as one chat message: text joined, tool_use blocks as tool_calls; thinking blocks
    are left out (templates drop earlier turns' reasoning)."""
    text, calls = [], []
    for at, b in each_object(content, where):
        t = b.get("type")
        if t == "text":
            text.append(part_text(b, at))
        elif t == "tool_use":
            for key in ("id", "name"):
                if not isinstance(b.get(key), str):
                    raise _bad(f"{at}.{key}", "must be a string")
            if not isinstance(b.get("input", {}), dict):
                raise _bad(f"{at}.input", f"must be an object, got {schema._tname(b['input'])}")
            if schema.nesting(b.get("input")) > schema.MAX_ARGUMENT_DEPTH:
                raise _bad(f"{at}.input", f"nests deeper than {schema.MAX_ARGUMENT_DEPTH} levels")
            calls.append({"id": b["id"], "type": "function",
                          "function": {"name": b["name"], "arguments": json.dumps(b.get("input", {}),
                                                                                ensure_ascii=False)}})
        elif t in ("thinking", "redacted_thinking"):
            continue
        else:
            raise _unsupported(f"{at}.type", f"is {t!r}: an assistant turn's blocks Strata reads are text, "
                                             "tool_use and thinking")
    msg: dict = {"role": "assistant", "content": "".join(text)}
    if calls:
        msg["tool_calls"] = calls
    return msg


def _messages(msgs) -> list[dict]:
    if msgs is None:
        raise ApiError(400, "'messages' is required", param="messages", code="missing_required_parameter")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages", "must be a non-empty array of messages")
    out: list[dict] = []
    for where, m in each_object(msgs, "messages"):
        role, content = m.get("role"), m.get("content")
        if role not in ("user", "assistant"):
            raise _bad(f"{where}.role", f"must be 'user' or 'assistant', got {role!r} (the system prompt is 'system')")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
        elif not isinstance(content, list):
            raise _bad(f"{where}.content", f"must be a string or an array of content blocks, got "
                                           f"{schema._tname(content)}")
        elif role == "user":
            out += _user_messages(content, f"{where}.content")
        else:
            out.append(_assistant_message(content, f"{where}.content"))
    return out


def _tools(tools) -> list[dict] | None:
    """Anthropic's client tools ({"name", "description", "input_schema"}) in the chat shape; server tools (web
    search, code execution, ...) are not Strata's to run."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _bad("tools", f"must be an array of tool objects, got {schema._tname(tools)}")
    out = []
    for at, t in each_object(tools, "tools"):
        if t.get("type", "custom") != "custom":
            raise _unsupported(f"{at}.type", f"is {t.get('type')!r}: Strata runs client tools only (custom)")
        fn = {"name": t.get("name"), "parameters": t.get("input_schema", {"type": "object"})}
        if "description" in t:
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(tc) -> tuple[str | dict | None, bool | None]:
    """{"type": "auto" | "any" | "tool" | "none", "name", "disable_parallel_tool_use"} -> the chat route's
    (tool_choice, parallel_tool_calls)."""
    if tc is None:
        return None, None
    if not isinstance(tc, dict) or tc.get("type") not in TOOL_CHOICES:
        raise _bad("tool_choice", f"must be an object with 'type' one of {', '.join(TOOL_CHOICES)}")
    dp = tc.get("disable_parallel_tool_use")
    if dp is not None and not isinstance(dp, bool):
        raise _bad("tool_choice.disable_parallel_tool_use", "must be a boolean")
    parallel = None if dp is None else not dp
    kind = tc["type"]
    if kind == "tool":
        if not isinstance(tc.get("name"), str):
            raise _bad("tool_choice.name", "must be a string naming one of the tools")
        return {"type": "function", "function": {"name": tc["name"]}}, parallel
    return {"any": "required"}.get(kind, kind), parallel


def _output_format(oc) -> dict | None:
    """'output_config': {"format": {"type": "json_schema", "schema"}} (structured outputs, held to the schema) -> the
    chat route's response_format; 'effort' is accepted and has no effect."""
    if oc is None:
        return None
    if not isinstance(oc, dict):
        raise _bad("output_config", f"must be an object, got {schema._tname(oc)}")
    fmt = oc.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise _bad("output_config.format", 'must be {"type": "json_schema", "schema": {...}}')
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"], "strict": True}}


def parse(body: dict, *, count_only: bool = False) -> schema.ParsedRequest:
    """Validate a /v1/messages body (max_tokens required, except for count_tokens) and translate it into a chat
    request."""
    max_tokens = body.get("max_tokens")
    if max_tokens is None and not count_only:
        raise ApiError(400, "'max_tokens' is required", param="max_tokens", code="missing_required_parameter")
    if max_tokens is not None:
        schema._opt_int(body, "max_tokens", 1)
    system = body.get("system")
    msgs = _messages(body.get("messages"))
    if system is not None:
        msgs.insert(0, {"role": "system", "content": _text_blocks(system, "system")})
    stop = body.get("stop_sequences")
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise _bad("stop_sequences", "must be an array of strings")
    tool_choice, parallel = _tool_choice(body.get("tool_choice"))
    chat = {"model": body.get("model"), "stream": None if count_only else body.get("stream"),
            "max_tokens": max_tokens, "messages": msgs, "stop": stop or None, "tools": _tools(body.get("tools")),
            "tool_choice": tool_choice, "parallel_tool_calls": parallel,
            "response_format": _output_format(body.get("output_config")),
            "temperature": body.get("temperature"), "top_p": body.get("top_p")}
    chat.update({k: body[k] for k in schema.EXTENSION_FIELDS if k in body})
    p = schema.parse_chat({k: v for k, v in chat.items() if v is not None})
    p.continue_final = _prefill(msgs[-1], len(body["messages"]) - 1)
    return p


def _prefill(last: dict, i: int) -> bool:
    """Whether the conversation ends with an assistant message (Anthropic's prefill: the answer continues its text).
    Its text may not end in whitespace, as Anthropic's API requires, and it may hold no tool call."""
    if last["role"] != "assistant":
        return False
    if last.get("tool_calls"):
        raise _bad(f"messages[{i}].content", "is a final assistant message with tool_use blocks: only text can be "
                                             "continued")
    text = last.get("content") or ""
    if text != text.rstrip():
        raise _bad(f"messages[{i}].content", "final assistant content cannot end with trailing whitespace")
    return True


# chat-route field names in errors -> the Messages API's
_RENAMES = [(re.compile(r"\btools\[(\d+)\]\.function\.parameters"), r"tools[\1].input_schema"),
            (re.compile(r"\btools\[(\d+)\]\.function\."), r"tools[\1]."),
            (re.compile(r"\bresponse_format(\.json_schema)?"), "output_config.format"),
            (re.compile(r"^stop$|(?<=')stop(?=')"), "stop_sequences")]


def _renamed(e: ApiError) -> ApiError:
    return renamed(e, _RENAMES)


# ------------------------------------------------------------------------------------------------ the answer
def stop_reason(ab: AnswerBlocks, p: schema.ParsedRequest) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence): tool_use (an answer with calls that ended on its own), max_tokens,
    model_context_window_exceeded (the context filled before max_tokens), stop_sequence, end_turn."""
    f = ab.final
    if ab.finish_reason == "tool_calls":
        return "tool_use", None
    if f.finish_reason == "length":
        if p.max_tokens is not None and f.usage["completion_tokens"] < p.max_tokens:
            return "model_context_window_exceeded", None
        return "max_tokens", None
    by = (f.strata or {}).get("stopped_by")
    if by is not None and by in p.stop:
        return "stop_sequence", by
    return "end_turn", None


def _block(b: Block, done: bool) -> dict:
    """Block b as a content block: empty (content_block_start) or whole (done)."""
    if b.kind == "call":
        args = arguments_object(b.text) if done else None
        return {"type": "tool_use", "id": b.call_id, "name": b.name, "input": {} if args is None else args}
    if b.kind == "reasoning":
        return {"type": "thinking", "thinking": b.text if done else "", "signature": ""}
    return {"type": "text", "text": b.text if done else ""}


def usage_of(ab: AnswerBlocks) -> dict:
    """Anthropic's usage: input_tokens are the prompt tokens read, cache_read_input_tokens those the cache gave."""
    f = ab.final
    cached = int(f.timings.get("cache_n", 0) or 0)
    return {"input_tokens": f.usage["prompt_tokens"] - cached, "output_tokens": f.usage["completion_tokens"],
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


class _Message:
    """One answer being sent: its id, the message object, the stream's events."""

    def __init__(self, engine, p: schema.ParsedRequest, ab: AnswerBlocks, prompt_tokens: int):
        self.engine, self.p, self.ab, self.prompt_tokens = engine, p, ab, prompt_tokens
        self.id = "msg_" + uuid.uuid4().hex

    def obj(self, done: bool) -> dict:
        d = {"id": self.id, "type": "message", "role": "assistant", "model": self.engine.model_name, "content": [],
             "stop_reason": None, "stop_sequence": None,
             "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0, "cache_creation_input_tokens": 0,
                       "cache_read_input_tokens": 0}}
        if done:
            d["content"] = [_block(b, True) for b in self.ab.blocks]
            d["stop_reason"], d["stop_sequence"] = stop_reason(self.ab, self.p)
            d["usage"] = usage_of(self.ab)
            d["timings"], d["strata"] = timings_of(self.ab.final), strata_of(self.ab.final)
        return d

    async def stream(self, job):
        """message_start, each block's content_block_start / _delta (text_delta, thinking_delta, input_json_delta) /
        _stop, message_delta (stop_reason, the final usage, Strata's timings and strata), message_stop."""
        started = False
        async for what, b, text in self.ab.events(job):
            if not started:
                started = True
                yield "message_start", {"type": "message_start", "message": self.obj(False)}
            if what == "start":
                yield "content_block_start", {"type": "content_block_start", "index": b.index,
                                              "content_block": _block(b, False)}
            elif what == "delta":
                delta = {"call": {"type": "input_json_delta", "partial_json": text},
                         "reasoning": {"type": "thinking_delta", "thinking": text}}.get(
                    b.kind, {"type": "text_delta", "text": text})
                yield "content_block_delta", {"type": "content_block_delta", "index": b.index, "delta": delta}
            else:
                yield "content_block_stop", {"type": "content_block_stop", "index": b.index}
        if not started:
            yield "message_start", {"type": "message_start", "message": self.obj(False)}
        d = self.obj(True)
        yield "message_delta", {"type": "message_delta", "delta": {"stop_reason": d["stop_reason"],
                                                                   "stop_sequence": d["stop_sequence"]},
                                "usage": d["usage"], "timings": d["timings"], "strata": d["strata"]}
        yield "message_stop", {"type": "message_stop"}


def _failed(e: ApiError) -> list[tuple[str, dict]]:
    return [("error", anthropic_error(_renamed(e)))]


async def _respond(request, engine, p, job, answers):
    m = _Message(engine, p, AnswerBlocks(answers[0]), len(job.request.prompt_tokens))
    if p.stream:
        return await send_events(request, job, m.stream(job), _failed)
    async for _ in m.ab.events(job):
        pass
    return json_response(m.obj(True))


# ------------------------------------------------------------------------------------------------ routes
async def create_message(request: web.Request) -> web.StreamResponse:
    """POST /v1/messages."""
    body = await read_body(request)
    try:
        p = await prepared(request, lambda: parse(body))
        return await generate_chat(request, p, respond=_respond)
    except ApiError as e:
        raise _renamed(e) from None


async def count_tokens(request: web.Request) -> web.Response:
    """POST /v1/messages/count_tokens: the prompt's tokens as the template renders it (tools included), nothing
    generated."""
    body = await read_body(request)
    try:
        p = await prepared(request, lambda: parse(body, count_only=True))
        _engine, _plan, rendered = await render_chat(request, p)
    except ApiError as e:
        raise _renamed(e) from None
    return json_response({"input_tokens": len(rendered.tokens)})


def add_routes(app: web.Application) -> None:
    """Register the routes and their error shape on `app` (make_app calls this)."""
    r = app.router
    for route in (r.add_post("/v1/messages", create_message), r.add_post("/v1/messages/count_tokens", count_tokens)):
        app[ERROR_SHAPES_KEY][route.resource.canonical] = anthropic_error
    app[ERROR_SHAPES_KEY]["/v1/messages/"] = anthropic_error   # unknown routes under /v1/messages/ too
