"""OpenAI request validation: JSON bodies of /v1/chat/completions and /v1/completions -> ParsedRequest.

Field names and ranges follow the OpenAI API reference (https://platform.openai.com/docs/api-reference/chat)
with llama.cpp's server extensions (top_k, min_p, repeat_penalty, cache_prompt, chat_template_kwargs,
reasoning_format, json_schema, grammar, logit_bias's array form) and Strata's own (strata_checkpoint, strata_spec,
strata_pin). Every refusal is an ApiError(400, one line naming the field). Unknown fields are ignored (clients send
many optional ones), except those that would change the answer in a way Strata cannot honour (best_of > 1, echo,
suffix, image parts).
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from strata.serve.errors import ApiError
from strata.structured.tool_calls import NAME_RE
from strata.text.chat_template import MAX_ARGUMENT_DEPTH, nesting

MAX_STOP = 16
MAX_STOP_CHARS = 512       # per stop string: matching a held-back prefix costs up to len^2 per generated token
MAX_TOP_LOGPROBS = 20
MAX_N = 16                 # choices per request (each one a full decode after the one prompt read)
ROLES = ("system", "developer", "user", "assistant", "tool", "function")
# llama.cpp's and Strata's request fields that the Responses and Messages routes pass on to the chat request as they are
EXTENSION_FIELDS = ("top_k", "min_p", "seed", "repeat_penalty", "repeat_last_n", "presence_penalty",
                    "frequency_penalty", "cache_prompt", "strata_checkpoint", "strata_spec", "chat_template_kwargs",
                    "reasoning_format", "id_slot")


@dataclass
class ParsedRequest:
    kind: str                                   # "chat" | "completion"
    model: str | None
    n: int = 1                                  # choices
    stream: bool = False
    include_usage: bool = False
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    sampling: dict[str, Any] = field(default_factory=dict)   # keyword arguments of SamplingParams
    logprobs: bool = False
    top_logprobs: int = 0
    cache_prompt: bool = True
    checkpoint: bool = True
    spec: bool | None = None                    # strata_spec: False turns speculative decoding off
    id_slot: int | None = None                  # llama-server's id_slot: the request slot to run in (None: any)
    pin: int | None = None
    messages: list[dict] | None = None          # chat
    tools: list | None = None                   # chat: [{"type": "function", "function": {"name", ...}}]
    tool_choice: str | dict = "auto"            # chat: "none" | "auto" | "required" | {"type": "function", ...}
    parallel_tool_calls: bool = True            # chat
    template_kwargs: dict = field(default_factory=dict)   # chat: chat_template_kwargs (e.g. enable_thinking)
    continue_final: bool = False      # chat: the last (assistant) message is left open and the answer continues it
    reasoning: bool = True                      # chat: reasoning_format other than "none"
    output: dict | None = None                  # {"type": "json_schema", "schema", "strict"} | {"type": "grammar",
                                                # "grammar"}: the answer constrained (response_format, json_schema,
                                                # grammar)
    prompt: str | list[int] | None = None       # completion: text or token ids


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def parse_json(raw: bytes) -> dict:
    """Decode a request body; ApiError(400) for invalid UTF-8/JSON (NaN and Infinity included) or a non-object."""
    if not raw.strip():
        raise ApiError(400, "the request body is empty: send a JSON object")
    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except UnicodeDecodeError as e:
        raise ApiError(400, f"the request body is not UTF-8: {e.reason} at byte {e.start}") from None
    except RecursionError:
        raise ApiError(400, "the request body is not valid JSON: nested too deeply") from None
    except ValueError as e:
        if "int_max_str_digits" in str(e) or "integer string conversion" in str(e):
            raise ApiError(400, "the request body holds an integer of more than 4300 digits") from None
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {_tname(body)}")
    return body


def _tname(v) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "an integer",
            float: "a number", type(None): "null"}.get(type(v), type(v).__name__)


_PLAIN_KEY = re.compile(r"\A[A-Za-z_$][A-Za-z0-9_$-]{0,63}\Z")


def _bad(param: str, msg: str) -> ApiError:
    return ApiError(400, f"'{param}' {msg}", param=param, code="invalid_value")


def _opt_bool(body: dict, key: str, default: bool) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(key, f"must be a boolean, got {_tname(v)}")
    return v


def _opt_int(body: dict, key: str, lo: int | None = None, hi: int | None = None) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad(key, f"must be an integer, got {_tname(v)}")
    if lo is not None and v < lo or hi is not None and v > hi:
        rng = f">= {lo}" if hi is None else f"in {lo}..{hi}"
        raise _bad(key, f"must be {rng}, got {v}")
    return v


def _opt_num(body: dict, key: str, lo: float, hi: float, *, lo_open: bool = False) -> float | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _bad(key, f"must be a number, got {_tname(v)}")
    v = float(v)
    if not math.isfinite(v) or v > hi or v < lo or (lo_open and v == lo):
        raise _bad(key, f"must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {v:g}")
    return v


def _common(body: dict, kind: str) -> ParsedRequest:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("model", f"must be a string, got {_tname(model)}")
    r = ParsedRequest(kind=kind, model=model)
    r.n = _opt_int(body, "n", 1, MAX_N) or 1
    best_of = _opt_int(body, "best_of", 1)
    if best_of is not None and best_of != 1:
        raise ApiError(400, f"'best_of' must be 1, got {best_of}", param="best_of", code="unsupported_value")
    r.stream = _opt_bool(body, "stream", False)
    so = body.get("stream_options")
    if so is not None:
        if not isinstance(so, dict):
            raise _bad("stream_options", f"must be an object, got {_tname(so)}")
        if not r.stream:
            raise _bad("stream_options", "is only allowed when 'stream' is true")
        r.include_usage = _opt_bool(so, "include_usage", False)
    # a chat answer has at least one token, as OpenAI's chat API, Anthropic's and the Responses API require; a raw
    # completion may ask for none (OpenAI's legacy completions score a prompt with max_tokens 0)
    least = 1 if kind == "chat" else 0
    mt = _opt_int(body, "max_completion_tokens", least)
    mt2 = _opt_int(body, "max_tokens", least)
    if mt is not None and mt2 is not None and mt != mt2:
        raise _bad("max_tokens", f"and 'max_completion_tokens' disagree ({mt2} vs {mt}): send one")
    r.max_tokens = mt if mt is not None else mt2
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise _bad("stop", "must be a string or an array of strings")
        if len(stop) > MAX_STOP:
            raise _bad("stop", f"has {len(stop)} strings, at most {MAX_STOP} are allowed")
        if any(s == "" for s in stop):
            raise _bad("stop", "must not contain an empty string")
        long = next((s for s in stop if len(s) > MAX_STOP_CHARS), None)
        if long is not None:
            raise _bad("stop", f"has a string of {len(long)} characters, at most {MAX_STOP_CHARS} are allowed")
        r.stop = list(stop)
    s = r.sampling
    for key, lo, hi, lo_open in (("temperature", 0.0, 2.0, False), ("top_p", 0.0, 1.0, True),
                                 ("min_p", 0.0, 1.0, False), ("presence_penalty", -2.0, 2.0, False),
                                 ("frequency_penalty", -2.0, 2.0, False), ("repeat_penalty", 0.0, 10.0, True)):
        v = _opt_num(body, key, lo, hi, lo_open=lo_open)
        if v is not None:
            s[key] = v
    top_k = _opt_int(body, "top_k", 0)
    if top_k is not None:
        s["top_k"] = top_k
    last_n = _opt_int(body, "repeat_last_n", -1)      # llama.cpp's: the penalties' history (0 none, -1 all)
    if last_n is not None:
        s["repeat_last_n"] = last_n
    seed = _opt_int(body, "seed", -1, 2 ** 64 - 1)
    if seed is not None:
        s["seed"] = seed
    lb = _logit_bias(body.get("logit_bias"))
    if lb:
        s["logit_bias"] = lb
    r.output = _response_format(body.get("response_format"))
    r.cache_prompt = _opt_bool(body, "cache_prompt", True)
    r.checkpoint = _opt_bool(body, "strata_checkpoint", True)
    r.spec = None if body.get("strata_spec") is None else _opt_bool(body, "strata_spec", True)
    slot = _opt_int(body, "id_slot", -1)         # llama-server's: -1 (any) or a slot; the engine checks the range
    r.id_slot = None if slot is None or slot == -1 else slot
    return r


_TOKEN_KEY = re.compile(r"\A[0-9]{1,10}\Z")


def _logit_bias(lb) -> tuple[tuple[int, float], ...]:
    """'logit_bias': OpenAI's object {"token id": bias}, or llama-server's array [[token id, bias], ...]; a bias is a
    number, or false (llama-server's: the token is never chosen, -inf). Token ids only (a text key is refused: token
    ids are the model's). The form is read here; the rules on the pairs (count, id, range, each id once) are the
    sampler's (strata.sampling.sampler.check_logit_bias), refused with the field named by the entry's path here. The
    ids are checked against the vocabulary by the engine before the request is queued. -> (id, bias) pairs sorted
    by id."""
    from strata.sampling.sampler import BiasRefused, check_logit_bias
    if lb is None:
        return ()
    if isinstance(lb, dict):
        keys = list(lb)
        for k in keys:
            if not _TOKEN_KEY.match(k):
                raise _bad("logit_bias", f"has the key {json.dumps(k)[:80]}: keys must be token ids (decimal "
                                         "integers >= 0), not text")
        items = [(int(k), v) for k, v in lb.items()]
    elif isinstance(lb, list):
        items = []
        for j, e in enumerate(lb):
            if not isinstance(e, list) or len(e) != 2:
                raise _bad(f"logit_bias[{j}]", "must be a [token id, bias] pair")
            items.append((e[0], e[1]))
    else:
        raise _bad("logit_bias", 'must be an object {"token id": bias} or an array of [token id, bias] pairs, got '
                                 f"{_tname(lb)}")
    try:
        return check_logit_bias([(k, -math.inf if v is False else v) for k, v in items])
    except BiasRefused as e:
        if e.entry is None:
            where = "logit_bias"
        elif isinstance(lb, dict):
            where = _json_key_path("logit_bias", keys[e.entry])
        else:
            where = f"logit_bias[{e.entry}]" + ("" if e.part is None else f"[{e.part}]")
        raise _bad(where, e.problem) from None


def _unicode_text(text: str, where: str) -> str:
    """text, or ApiError(400) naming the field and the position of a lone surrogate (JSON "\\ud800" decodes to
    one; it has no UTF-8 encoding, so no tokens)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise _bad(where, f"is not valid Unicode: lone surrogate U+{ord(text[e.start]):04X} at code point "
                          f"{e.start} of the text") from None
    return text


def _json_key_path(path: str, key: str) -> str:
    return f"{path}.{key}" if _PLAIN_KEY.match(key) else f"{path}[{json.dumps(key)}]"


def unicode_json(value, where: str):
    """value (a decoded JSON value), or ApiError(400) naming the path of the first string or object key in it that
    holds a lone surrogate (no UTF-8 encoding: it could reach neither a grammar nor a JSON answer)."""
    stack = [(where, value)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, str):
            _unicode_text(v, path)
        elif isinstance(v, dict):
            for k, item in v.items():
                try:
                    k.encode("utf-8")
                except UnicodeEncodeError as e:
                    raise _bad(path, f"has a key that is not valid Unicode: lone surrogate U+{ord(k[e.start]):04X} "
                                     f"at code point {e.start} of the key") from None
                stack.append((_json_key_path(path, k), item))
        elif isinstance(v, list):
            stack.extend((f"{path}[{i}]", item) for i, item in enumerate(v))
    return value


def _content_text(content, i: int, role: str) -> str | None:
    where = f"messages[{i}].content"
    if content is None:
        if role in ("assistant",):
            return None
        raise _bad(where, "must be a string or an array of text parts, got null")
    if isinstance(content, str):
        return _unicode_text(content, where)
    if isinstance(content, list):
        out = []
        for j, part in enumerate(content):
            if not isinstance(part, dict):
                raise _bad(f"{where}[{j}]", f"must be an object, got {_tname(part)}")
            t = part.get("type")
            if t != "text":
                raise ApiError(400, f"'{where}[{j}]' has type {t!r}: only 'text' parts are supported",
                               param=where, code="unsupported_value")
            if not isinstance(part.get("text"), str):
                raise _bad(f"{where}[{j}].text", "must be a string")
            out.append(_unicode_text(part["text"], f"{where}[{j}].text"))
        return "".join(out)
    raise _bad(where, f"must be a string or an array of text parts, got {_tname(content)}")


_ROLE_SET = frozenset(ROLES)


def _plain_unicode(msgs: list, plain: list[str], upto: int) -> None:
    """The contents of plain messages before message `upto` (`plain`) checked for a lone surrogate in one pass; the
    error names the first message that holds one, as the check of each message would."""
    try:
        "".join(plain).encode("utf-8")
    except UnicodeEncodeError:
        for i, m in enumerate(msgs[:upto]):
            if type(m) is dict and type(m.get("content")) is str:
                _unicode_text(m["content"], f"messages[{i}].content")


def parse_chat(body: dict) -> ParsedRequest:
    """Validate a /v1/chat/completions body."""
    r = _common(body, "chat")
    msgs = body.get("messages")
    if msgs is None:
        raise ApiError(400, "'messages' is required", param="messages", code="missing_required_parameter")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages", "must be a non-empty array of message objects")
    out = []
    plain = []              # contents of the messages that are just a role and a string (checked at once below)
    for i, m in enumerate(msgs):
        if type(m) is dict and len(m) == 2:           # the common message: {"role": ..., "content": "..."}
            role, content = m.get("role"), m.get("content")
            if type(content) is str and type(role) is str and role in _ROLE_SET:
                out.append({"role": "system" if role == "developer" else role, "content": content})
                plain.append(content)
                continue
        _plain_unicode(msgs, plain, i)
        plain = []
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}]", f"must be an object, got {_tname(m)}")
        role = m.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise _bad(f"messages[{i}].role", f"must be one of {', '.join(ROLES)}, got {role!r}")
        msg: dict[str, Any] = {"role": "system" if role == "developer" else role,
                               "content": _content_text(m.get("content"), i, role)}
        for key in ("name", "tool_call_id"):
            if m.get(key) is not None:
                if not isinstance(m[key], str):
                    raise _bad(f"messages[{i}].{key}", "must be a string")
                msg[key] = m[key]
        tc = m.get("tool_calls")
        if tc is not None:
            msg["tool_calls"] = _message_tool_calls(tc, i)
        if msg["content"] is None:
            msg["content"] = ""
        out.append(msg)
    _plain_unicode(msgs, plain, len(msgs))
    r.messages = out
    r.tools = _tools(body.get("tools"))
    tc = body.get("tool_choice")
    if isinstance(tc, dict) and tc.get("type") == "allowed_tools":
        r.tools, tc = allowed_tools(tc.get("allowed_tools"), r.tools)
    r.tool_choice = _tool_choice(tc, r.tools)
    r.parallel_tool_calls = _opt_bool(body, "parallel_tool_calls", True)
    _grammar_fields(body, r)
    if r.output is not None and (r.tool_choice == "required" or isinstance(r.tool_choice, dict)):
        raise _bad(r.output.get("param", "response_format"), "cannot be combined with a tool_choice that forces a "
                                                             "tool call")
    if r.output is not None and r.output["type"] == "grammar" and r.tools and r.tool_choice != "none":
        raise _bad("grammar", "cannot be combined with tools (the tool calls have their own grammar), as in "
                              "llama-server")
    r.template_kwargs = _template_kwargs(body.get("chat_template_kwargs"))
    rfmt = body.get("reasoning_format")
    if rfmt is not None and rfmt not in REASONING_FORMATS:
        raise _bad("reasoning_format", f"must be one of {', '.join(REASONING_FORMATS)}, got {rfmt!r}")
    r.reasoning = rfmt != "none"
    r.logprobs = _opt_bool(body, "logprobs", False)
    tl = _opt_int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if tl is not None:
        if tl and not r.logprobs:
            raise _bad("top_logprobs", "needs 'logprobs': true")
        r.top_logprobs = tl
    pin = _opt_int(body, "strata_pin", 0)
    if pin is not None and pin >= len(out):
        raise _bad("strata_pin", f"names message {pin} but there are {len(out)} messages (0..{len(out) - 1})")
    r.pin = pin
    return r


def parse_completion(body: dict) -> ParsedRequest:
    """Validate a /v1/completions body (prompt: a string, one-string array, token ids, or one id array)."""
    r = _common(body, "completion")
    if "prompt" not in body or body["prompt"] is None:
        raise ApiError(400, "'prompt' is required", param="prompt", code="missing_required_parameter")
    p = body["prompt"]
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, str):
        r.prompt = p
    elif isinstance(p, list) and p and set(map(type, p)) == {int}:      # JSON integers (not true / false), in C
        r.prompt = list(p)
    elif isinstance(p, list) and len(p) > 1 and all(isinstance(t, (str, list)) for t in p):
        raise ApiError(400, "'prompt' holds several prompts: Strata answers one prompt per request",
                       param="prompt", code="unsupported_value")
    else:
        raise _bad("prompt", "must be a string, an array of one string, or a non-empty array of token ids")
    if _opt_bool(body, "echo", False):
        raise ApiError(400, "'echo' is not supported", param="echo", code="unsupported_value")
    if body.get("suffix") not in (None, ""):
        raise ApiError(400, "'suffix' is not supported", param="suffix", code="unsupported_value")
    lp = _opt_int(body, "logprobs", 0, MAX_TOP_LOGPROBS)
    if lp is not None:
        r.logprobs = True
        r.top_logprobs = lp
    _grammar_fields(body, r)
    return r


def _grammar_fields(body: dict, r: ParsedRequest) -> None:
    """llama-server's `json_schema` (a schema) and `grammar` (GBNF, or Lark after %llguidance) into r.output; an
    empty `grammar` is no grammar, as llama-server reads it. One of them, and not beside response_format."""
    js, gr = body.get("json_schema"), body.get("grammar")
    gr = None if gr == "" else gr
    if js is not None and gr is not None:
        raise _bad("grammar", "and 'json_schema' are both set: send one")
    if (js is not None or gr is not None) and r.output is not None:
        name = "json_schema" if js is not None else "grammar"
        raise _bad(name, "and 'response_format' are both set: send one")
    if js is not None:
        if not isinstance(js, dict):
            raise _bad("json_schema", f"must be a JSON schema object, got {_tname(js)}")
        r.output = {"type": "json_schema", "schema": unicode_json(js, "json_schema"), "strict": True,
                    "param": "json_schema"}
    elif gr is not None:
        if not isinstance(gr, str) or not gr.strip():
            raise _bad("grammar", "must be a string holding a GBNF grammar (or Lark after %llguidance); an empty "
                                  "one is no grammar")
        _unicode_text(gr, "grammar")
        r.output = {"type": "grammar", "grammar": gr, "param": "grammar"}


# ---- tools and structured output -------------------------------------------------------------------------------

REASONING_FORMATS = ("auto", "none", "deepseek", "deepseek-legacy")
# the chat template's own variables: chat_template_kwargs may not replace them
RESERVED_TEMPLATE_VARS = ("messages", "tools", "documents", "add_generation_prompt", "pin_message", "text_check",
                          "bos_token", "eos_token")


def _tools(tools) -> list[dict] | None:
    """'tools': OpenAI function tools, [{"type": "function", "function": {"name", "description"?, "parameters"?,
    "strict"?}}]."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _bad("tools", f"must be an array of tool objects, got {_tname(tools)}")
    names = set()
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict):
            raise _bad(where, f"must be an object, got {_tname(t)}")
        if t.get("type", "function") != "function":
            raise ApiError(400, f"'{where}.type' is {json.dumps(t.get('type'))[:80]}: only 'function' tools are "
                                "supported", param=where, code="unsupported_value")
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise _bad(f"{where}.function", "must be an object with a 'name'")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise _bad(f"{where}.function.name", "must be 1-64 letters, digits, '_', '.' or '-', got "
                                                 f"{json.dumps(name)[:80]}")
        if name in names:
            raise _bad(f"{where}.function.name", f"{name!r} names two tools")
        names.add(name)
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise _bad(f"{where}.function.description", "must be a string")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise _bad(f"{where}.function.parameters", f"must be a JSON schema object, got {_tname(fn['parameters'])}")
        unicode_json(fn, f"{where}.function")
        if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
            raise _bad(f"{where}.function.strict", "must be a boolean")
    return tools or None


def _tool_choice(tc, tools: list[dict] | None):
    """'tool_choice': "none" | "auto" (the default) | "required" | {"type": "function", "function": {"name": N}}
    naming one of the tools."""
    if tc is None:
        return "auto"
    if tc in ("none", "auto"):
        return tc
    if tc == "required" or isinstance(tc, dict):
        if not tools:
            raise _bad("tool_choice", f"{json.dumps(tc)} needs 'tools'")
        if tc == "required":
            return tc
        fn = tc.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if tc.get("type") != "function" or not isinstance(name, str):
            raise _bad("tool_choice", 'must be {"type": "function", "function": {"name": ...}} to name a function')
        known = [t["function"]["name"] for t in tools]
        if name not in known:
            raise _bad("tool_choice", f"names the function {name!r}, which is not among the tools "
                                      f"({', '.join(known)})")
        return {"type": "function", "function": {"name": name}}
    raise _bad("tool_choice", 'must be "none", "auto", "required" or a function object')


def allowed_tools(spec, tools: list[dict] | None, at: str = "tool_choice.allowed_tools",
                  flat: bool = False) -> tuple[list[dict], str]:
    """A 'tool_choice' of type allowed_tools: the model may call only the named tools -> (those tools, the mode as a
    tool_choice). spec is chat's {"mode": "auto" | "required", "tools": [{"type": "function", "function": {"name":
    N}}, ...]} (the tool_choice's 'allowed_tools'), or with flat the Responses API's tool_choice itself, whose items
    are {"type": "function", "name": N}; a 400 names the field under `at`. The tools the request lists but does not
    allow are left out of the prompt too (OpenAI keeps them there for its prompt cache), so the model neither sees
    nor calls them."""
    item = '{"type": "function", "name": ...}' if flat else '{"type": "function", "function": {"name": ...}}'
    if not isinstance(spec, dict):
        raise _bad(at, "must be an object with 'mode' and 'tools'")
    mode = spec.get("mode")
    if mode not in ("auto", "required"):
        raise _bad(f"{at}.mode", f'must be "auto" or "required", got {json.dumps(mode)[:40]}')
    allowed = spec.get("tools")
    if not isinstance(allowed, list) or not allowed:
        raise _bad(f"{at}.tools", f"must be a non-empty array of {item}")
    if not tools:
        raise _bad("tool_choice", "allowed_tools needs 'tools'")
    known = {t["function"]["name"]: t for t in tools}
    names = []
    for j, a in enumerate(allowed):
        fn = a if flat else a.get("function") if isinstance(a, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(a, dict) or a.get("type", "function") != "function" or not isinstance(name, str):
            raise _bad(f"{at}.tools[{j}]", f"must be {item}")
        if name not in known:
            raise _bad(f"{at}.tools[{j}]", f"names the function {name!r}, which is not among the tools "
                                           f"({', '.join(known)})")
        names.append(name)
    return [t for t in tools if t["function"]["name"] in names], mode


def _message_tool_calls(tc, i: int) -> list[dict]:
    """An assistant message's 'tool_calls' (as an earlier answer returned them)."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(tc, list):
        raise _bad(where, "must be an array of tool call objects")
    for j, c in enumerate(tc):
        if not isinstance(c, dict) or not isinstance(c.get("function"), dict):
            raise _bad(f"{where}[{j}]", "must be an object with a 'function' object")
        fn = c["function"]
        if not isinstance(fn.get("name"), str):
            raise _bad(f"{where}[{j}].function.name", "must be a string")
        if fn.get("arguments") is not None and not isinstance(fn["arguments"], (str, dict)):
            raise _bad(f"{where}[{j}].function.arguments", "must be a JSON string (or an object)")
        if nesting(fn.get("arguments")) > MAX_ARGUMENT_DEPTH:
            raise _bad(f"{where}[{j}].function.arguments", f"nests deeper than {MAX_ARGUMENT_DEPTH} levels")
        if c.get("id") is not None and not isinstance(c["id"], str):
            raise _bad(f"{where}[{j}].id", "must be a string")
    return tc


def _template_kwargs(kw) -> dict:
    if kw is None:
        return {}
    if not isinstance(kw, dict):
        raise _bad("chat_template_kwargs", f"must be an object, got {_tname(kw)}")
    for k in kw:
        if not k.isidentifier():
            raise _bad("chat_template_kwargs", f"has the key {k!r}, which is not a template variable name")
        if k in RESERVED_TEMPLATE_VARS:
            raise _bad("chat_template_kwargs", f"may not set {k!r} (the server sets it)")
    return dict(kw)


def _response_format(rf) -> dict | None:
    """'response_format': {"type": "text"} (None), {"type": "json_object"} (llama.cpp's server also takes a
    "schema" there), {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}."""
    if rf is None:
        return None
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise _bad("response_format", "must be an object with a string 'type'")
    t = rf["type"]
    if t == "text":
        return None
    if t == "json_object":
        schema = rf.get("schema", {"type": "object"})
        if not isinstance(schema, dict):
            raise _bad("response_format.schema", f"must be a JSON schema object, got {_tname(schema)}")
        return {"type": "json_schema", "schema": unicode_json(schema, "response_format.schema"), "strict": True,
                "param": "response_format"}
    if t == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise _bad("response_format.json_schema", "must be an object with a 'schema'")
        schema = js.get("schema", {"type": "object"})
        if not isinstance(schema, dict):
            raise _bad("response_format.json_schema.schema", f"must be a JSON schema object, got {_tname(schema)}")
        strict = js.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise _bad("response_format.json_schema.strict", "must be a boolean")
        return {"type": "json_schema", "schema": unicode_json(schema, "response_format.json_schema.schema"),
                "strict": bool(strict), "param": "response_format"}
    raise ApiError(400, f"'response_format' type {t!r} is not supported (text, json_object, json_schema)",
                   param="response_format", code="unsupported_value")
