"""Tool calls in model output: each template family's call format (chosen from the chat template's text), its parser
(whole answers and streamed alike), the grammar that forces a call, and the messages and prompt its template needs.

Families (the formats llama.cpp's server and vLLM parse):
  hermes      Qwen2.5 / Qwen3 / Qwen3-Next / Hermes:  <tool_call>\\n{"name": N, "arguments": {...}}\\n</tool_call>
  qwen_xml    Qwen3-Coder / Qwen3.5:  <tool_call>\\n<function=N>\\n<parameter=P>\\nV\\n</parameter>\\n</function>\\n</tool_call>
  llama3      Llama 3.1-3.3 JSON tool calling:  {"name": N, "parameters": {...}} (or after <|python_tag|>; ';' between)
  mistral     [TOOL_CALLS][{"name": N, "arguments": {...}}, ...]  or (v11+ tokenizers) [TOOL_CALLS]N[ARGS]{...}
  generic     templates that know no tools (llama.cpp's generic handler): the system prompt lists the tools and the
              answer is one JSON object, {"tool_calls": [{"name": N, "arguments": {...}}]} or {"response": "..."},
              held to that shape by a grammar.
The <tool_call> reader takes both the JSON and the XML body, whichever the model writes.

The parser that reads calls out of an answer as it streams is strata.structured.tool_parse's CallParser; parse() reads a whole
answer through it.
"""
from __future__ import annotations

import copy
import json
import math
import re
import secrets
import string

import jiter

from strata.sampling.grammar import lark_json
from strata.structured.json_stream import ValueEnd, skip_ws
from strata.structured.tool_parse import (CallParser, Event, GenericBlock, Llama3Block, MistralBlock, TagBlock, assemble,
                                         hold_from, is_string, xml_value)

__all__ = ["NAME_RE", "ToolFormat", "Hermes", "QwenXml", "Llama3", "Mistral", "Generic", "detect", "generic_schema",
           "template_messages", "generic_system_prompt", "parse", "assemble", "xml_value", "Event", "CallParser",
           "arguments_object"]

NAME_RE = re.compile(r"\A[A-Za-z0-9_.\-]{1,64}\Z")      # OpenAI's function-name rule
_ALNUM = string.ascii_letters + string.digits


# ---------------------------------------------------------------------------------------------------- families

class ToolFormat:
    """A template family's tool-call format. native: the chat template renders the tools itself (else the generic
    system prompt carries them)."""
    name = ""
    native = True
    markers: tuple[str, ...] = ()
    marker_tokens: tuple[str, ...] = ()     # control tokens whose text the answer must show for the parser

    def new_id(self) -> str:
        return "call_" + "".join(secrets.choice(_ALNUM) for _ in range(24))

    def parser(self, tools: list[dict] | None = None) -> "CallParser":
        return CallParser(self, tools)

    def find(self, buf: str, at_start: bool):
        """(index of the earliest call block in buf, its reader), or (index from which text must be held, None)."""
        best = None
        for m in self.markers:
            i = buf.find(m)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, m)
        if best is not None:
            return best[0], self.reader(best[1])
        return hold_from(buf, self.markers), None

    def reader(self, marker: str):
        raise NotImplementedError

    def grammar(self, tools: list[dict], choice, parallel: bool, special) -> str:
        """The Lark rules (start rule `calls`) of an answer made of tool calls only: one call to the named function
        (choice {"type": "function", ...}), or one or more calls (one when not parallel) to any of the tools.
        special(text) gives a token reference for a control token's text, or None when the vocabulary has none."""
        raise NotImplementedError


class Hermes(ToolFormat):
    name = "hermes"
    markers = ("<tool_call>",)

    def reader(self, marker):
        return TagBlock(marker)

    def grammar(self, tools, choice, parallel, special):
        call = lark_json(_call_schemas(tools, choice, "arguments"))
        rep = '("\\n" tc)*' if parallel and not isinstance(choice, dict) else ""
        return f'calls: tc {rep}\ntc: "<tool_call>\\n" {call} "\\n</tool_call>"\n'


class QwenXml(Hermes):
    name = "qwen_xml"

    def grammar(self, tools, choice, parallel, special):
        fns = _chosen(tools, choice)
        rules, alts = [], []
        for k, fn in enumerate(fns):
            params = fn.get("parameters") or {}
            props = params.get("properties") or {}
            req = [p for p in (params.get("required") or []) if p in props]
            parts = [_lit(f"<function={fn['name']}>\n")]
            for j, pname in enumerate(req):
                rule = f"p{k}_{j}"
                head = _lit(f"<parameter={pname}>\n")
                parts.append(f'{head} {rule} "\\n</parameter>\\n"')
                rules.append(_xml_value_rule(rule, props[pname]))
            parts.append('"</function>"')
            rules.append(f"f{k}: " + " ".join(parts))
            alts.append(f"f{k}")
        rep = '("\\n" tc)*' if parallel and not isinstance(choice, dict) else ""
        return (f'calls: tc {rep}\ntc: "<tool_call>\\n" fn "\\n</tool_call>"\nfn: {" | ".join(alts)}\n'
                + "\n".join(rules) + "\n")


class Llama3(ToolFormat):
    name = "llama3"
    markers = ("<|python_tag|>",)
    marker_tokens = ("<|python_tag|>",)

    def find(self, buf, at_start):
        if at_start:
            j = skip_ws(buf, 0)
            if j < len(buf) and buf[j] == "{":
                return j, Llama3Block("")
            if j == len(buf):
                return 0, None
        return super().find(buf, at_start)

    def reader(self, marker):
        return Llama3Block(marker)

    def grammar(self, tools, choice, parallel, special):
        call = lark_json(_call_schemas(tools, choice, "parameters"))
        rep = '("; " tc)*' if parallel and not isinstance(choice, dict) else ""
        return f"calls: tc {rep}\ntc: {call}\n"


class Mistral(ToolFormat):
    name = "mistral"
    markers = ("[TOOL_CALLS]",)
    marker_tokens = ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]")

    def __init__(self, args_form: bool = False):
        self.args_form = args_form            # the v11+ form [TOOL_CALLS]name[ARGS]{...}

    def new_id(self) -> str:
        return "".join(secrets.choice(_ALNUM) for _ in range(9))    # Mistral's templates require 9 characters

    def reader(self, marker):
        return MistralBlock(marker)

    def grammar(self, tools, choice, parallel, special):
        tc = special("[TOOL_CALLS]") or '"[TOOL_CALLS]"'
        single = not parallel or isinstance(choice, dict)
        if self.args_form:
            args = special("[ARGS]") or '"[ARGS]"'
            alts = [f'{_lit(fn["name"])} {args} {lark_json(_params(fn))}' for fn in _chosen(tools, choice)]
            return f"calls: tc{'' if single else '+'}\ntc: {tc} fn\nfn: " + " | ".join(alts) + "\n"
        arr = {"type": "array", "items": {"anyOf": _call_schemas(tools, choice, "arguments")}, "minItems": 1}
        if single:
            arr["maxItems"] = 1
        return f"calls: {tc} {lark_json(arr)}\n"


class Generic(ToolFormat):
    name = "generic"
    native = False

    def find(self, buf, at_start):
        if at_start:
            j = skip_ws(buf, 0)
            if j < len(buf) and buf[j] == "{":
                return j, GenericBlock()
            if j == len(buf):
                return 0, None
        return len(buf), None

    def grammar(self, tools, choice, parallel, special):
        return f"calls: {lark_json(generic_schema(tools, choice, parallel, allow_response=False))}\n"


def generic_schema(tools, choice, parallel: bool, allow_response: bool) -> dict:
    """The JSON schema of a generic-format answer: {"tool_calls": [calls]} (one call when not parallel or when a
    function is named), or {"response": text} too when allow_response (tool_choice "auto")."""
    arr = {"type": "array", "items": {"anyOf": _call_schemas(tools, choice, "arguments")}, "minItems": 1}
    if not parallel or isinstance(choice, dict):
        arr["maxItems"] = 1
    calls = {"type": "object", "properties": {"tool_calls": arr}, "required": ["tool_calls"],
             "additionalProperties": False}
    if not allow_response:
        return calls
    resp = {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"],
            "additionalProperties": False}
    return {"anyOf": [calls, resp]}


# ------------------------------------------------------------------------------------------------ detection

def detect(template_source: str | None) -> ToolFormat:
    """The family of a chat template, from its text (llama.cpp's common_chat_templates_init looks for the same
    markers): <function= with <tool_call> -> qwen_xml; <tool_call> -> hermes; [TOOL_CALLS] -> mistral (the
    [ARGS] form when the template writes [ARGS]); <|start_header_id|> with tools -> llama3; anything else ->
    generic."""
    t = template_source or ""
    if "<tool_call>" in t and "<function=" in t:
        return QwenXml()
    if "<tool_call>" in t:
        return Hermes()
    if "[TOOL_CALLS]" in t:
        return Mistral(args_form="[ARGS]" in t)
    if "<|start_header_id|>" in t and ("tools" in t or "<|python_tag|>" in t):
        return Llama3()
    return Generic()


# -------------------------------------------------------------------------------------- messages and prompt

def template_messages(messages: list[dict], fmt: ToolFormat, renders_tool_role: bool = True) -> list[dict]:
    """The chat messages as the family's template wants them: for a native family, tool calls as the client gave
    them (the chat template takes arguments as a string or an object as it reads them:
    strata.text.chat_template.ChatTemplate.object_arguments; missing arguments are an empty object); for the
    generic family, an assistant's calls written as the JSON answer the model gives (arguments as objects), and
    tool results as user messages when the template does not render the tool role."""
    out = []
    for m in messages:
        m = dict(m)
        calls = m.get("tool_calls")
        if m.get("role") == "assistant" and calls:
            calls = [_call_for_template(c, parse=not fmt.native) for c in calls]
            if fmt.native:
                m["tool_calls"] = calls
            else:
                body = {"tool_calls": [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                                       for c in calls]}
                m.pop("tool_calls")
                m["content"] = json.dumps(body, ensure_ascii=False)
        elif m.get("role") == "tool" and not fmt.native and not renders_tool_role:
            resp = {"tool": m.get("name"), "content": m.get("content")}
            if m.get("tool_call_id"):
                resp["id"] = m["tool_call_id"]
            m = {"role": "user", "content": json.dumps({"tool_response": resp}, ensure_ascii=False)}
        out.append(m)
    return out


def _call_for_template(c: dict, parse: bool) -> dict:
    c = copy.deepcopy(c)
    fn = c.get("function") if isinstance(c.get("function"), dict) else {}
    args = fn.get("arguments")
    if isinstance(args, str) and parse:
        try:
            parsed = json.loads(args)
        except ValueError:
            parsed = None
        fn["arguments"] = parsed if isinstance(parsed, dict) else {} if not args.strip() else args
    elif args is None:
        fn["arguments"] = {}
    c["function"] = fn
    c.setdefault("type", "function")
    return c


def generic_system_prompt(tools: list[dict]) -> str:
    """The text the generic family adds to the system prompt: the tools, and the answer's JSON shape. It depends on
    the tools alone (tool_choice and parallel_tool_calls act through the grammar), so the turns of an agent loop
    share their system prompt and with it their checkpoints."""
    fns = [{k: v for k, v in t["function"].items() if k in ("name", "description", "parameters")}
           for t in tools]
    return ("You can call these tools:\n" + json.dumps(fns, ensure_ascii=False) + "\n"
            'To call tools, answer with one JSON object: {"tool_calls": [{"name": <tool name>, "arguments": '
            '<arguments object>}, ...]}. Otherwise answer with {"response": <your answer>}.')


# ----------------------------------------------------------------------------------------------- grammar bits

def _chosen(tools, choice) -> list[dict]:
    fns = [t["function"] for t in tools]
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        fns = [f for f in fns if f["name"] == name]
    return fns


def _params(fn: dict) -> dict:
    p = fn.get("parameters")
    return p if isinstance(p, dict) and p else {"type": "object"}


def _call_schemas(tools, choice, args_key: str) -> list[dict]:
    return [{"type": "object", "properties": {"name": {"const": fn["name"]}, args_key: _params(fn)},
             "required": ["name", args_key], "additionalProperties": False} for fn in _chosen(tools, choice)]


def _lit(text: str) -> str:
    """A Lark string literal of any text (JSON's escapes are Lark's)."""
    return json.dumps(text, ensure_ascii=False)


def _xml_value_rule(rule: str, schema: dict) -> str:
    """A parameter value of the XML format: a string as raw text (its enum as choices, maxLength as a bound, no
    '<'), anything else as JSON."""
    schema = schema if isinstance(schema, dict) else {}
    if is_string(schema):
        if isinstance(schema.get("enum"), list) and all(isinstance(v, str) for v in schema["enum"]):
            return f"{rule}: " + " | ".join(_lit(v) for v in schema["enum"])
        hi = schema.get("maxLength")
        rep = f"{{{int(schema.get('minLength', 0))},{int(hi)}}}" if isinstance(hi, int) else "*"
        return f"{rule}: /[^<\\n]{rep}/"
    return f"{rule}: {lark_json(schema)}"


def parse(text: str, fmt: ToolFormat, tools: list[dict] | None = None) -> tuple[str, list[dict]]:
    """A whole answer -> (content, calls)."""
    p = fmt.parser(tools)
    return assemble(p.feed(text) + p.finish())


def arguments_object(text: str) -> dict | None:
    """A call's arguments (the text as generated) as the object an API that takes an object gets (the Messages API's
    tool_use input, Ollama's arguments): the object when the text is one JSON object; when it is one cut short
    (max_tokens), what it holds complete, read as the anthropic SDK reads a tool_use's streamed fragments (jiter's
    partial mode: an unfinished string or key left out); None for anything else: no arguments, not an object, an
    object followed by more text (a JSON string of arguments may hold one: taking its front would drop the rest
    unseen), one broken before its end, a number JSON cannot write back (NaN, Infinity, past float's range) or
    nesting past the parser's depth."""
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError):        # RecursionError: nested past the parser's depth
        scan = ValueEnd()
        if not text.lstrip().startswith("{") or scan.feed(text) >= 0 or scan.bad:     # whole (or broken): no cut
            return None
        try:
            value = jiter.from_json(text.encode(), partial_mode=True, allow_inf_nan=False)
        except (ValueError, RecursionError):
            return None
    return value if isinstance(value, dict) and _finite(value) else None


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _finite(v) -> bool:
    """Whether every number in the decoded JSON value v is finite (a literal like 1e999 decodes to inf)."""
    stack = [v]
    while stack:
        x = stack.pop()
        if isinstance(x, float) and not math.isfinite(x):
            return False
        if isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
    return True
