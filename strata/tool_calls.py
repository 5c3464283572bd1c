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

Parsing is one streaming parser (CallParser): a whole answer is parsed by feeding it in one piece, so a streamed
answer and the same answer parsed whole give the same calls. A call is named as soon as its name is read and its
arguments stream as they arrive; text that turns out not to be a call before its name is read (a bad header, text
that is not JSON) comes back as content, unchanged.
"""
from __future__ import annotations

import copy
import json
import re
import secrets
import string
from dataclasses import dataclass

from strata.grammar import lark_json
from strata.json_stream import MORE, NO, OK, StringChars, ValueEnd, expect, skip_ws, string_at

NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")      # OpenAI's function-name rule
_ALNUM = string.ascii_letters + string.digits


@dataclass(frozen=True)
class Event:
    """A piece of parsed answer: kind "content" (text), "call" (a new call: index, id, name) or "args" (a fragment of
    call `index`'s arguments, JSON text)."""
    kind: str
    text: str = ""
    index: int = 0
    id: str = ""
    name: str = ""


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
        return _hold_from(buf, self.markers), None

    def reader(self, marker: str):
        raise NotImplementedError

    def grammar(self, tools: list[dict], choice, parallel: bool, special) -> str:
        """The Lark rules (start rule `calls`) of an answer made of tool calls only: one call to the named function
        (choice {"type": "function", ...}), or one or more calls (one when not parallel) to any of the tools.
        special(text) gives a token reference for a control token's text, or None when the vocabulary has none."""
        raise NotImplementedError


def _hold_from(buf: str, markers) -> int:
    """Where the longest tail of buf that could still become one of the markers starts (len(buf): none)."""
    hold = len(buf)
    for m in markers:
        for k in range(min(len(m) - 1, len(buf)), 0, -1):
            if buf.endswith(m[:k]):
                hold = min(hold, len(buf) - k)
                break
    return hold


class Hermes(ToolFormat):
    name = "hermes"
    markers = ("<tool_call>",)

    def reader(self, marker):
        return _TagBlock(marker)

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
                return j, _Llama3Block("")
            if j == len(buf):
                return 0, None
        return super().find(buf, at_start)

    def reader(self, marker):
        return _Llama3Block(marker)

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
        return _MistralBlock(marker)

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
                return j, _GenericBlock()
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
    """The chat messages as the family's template wants them: assistant tool-call arguments as objects (templates
    iterate or `tojson` them); for the generic family, an assistant's calls written as the JSON answer the model
    gives, and tool results as user messages when the template does not render the tool role."""
    out = []
    for m in messages:
        m = dict(m)
        calls = m.get("tool_calls")
        if m.get("role") == "assistant" and calls:
            calls = [_call_for_template(c) for c in calls]
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


def _call_for_template(c: dict) -> dict:
    c = copy.deepcopy(c)
    fn = c.get("function") if isinstance(c.get("function"), dict) else {}
    args = fn.get("arguments")
    if isinstance(args, str):
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
    if _is_string(schema):
        if isinstance(schema.get("enum"), list) and all(isinstance(v, str) for v in schema["enum"]):
            return f"{rule}: " + " | ".join(_lit(v) for v in schema["enum"])
        hi = schema.get("maxLength")
        rep = f"{{{int(schema.get('minLength', 0))},{int(hi)}}}" if isinstance(hi, int) else "*"
        return f"{rule}: /[^<\\n]{rep}/"
    return f"{rule}: {lark_json(schema)}"


def _is_string(schema: dict) -> bool:
    t = schema.get("type")
    return t == "string" or (isinstance(t, list) and "string" in t) or (
        t is None and isinstance(schema.get("enum"), list) and all(isinstance(v, str) for v in schema["enum"]))


def xml_value(raw: str, schema) -> object:
    """A parameter value of the XML format as JSON data: the text itself for string parameters (and parameters the
    tool does not describe), else the JSON it holds (the text when it holds none). One newline either side is the
    format's own."""
    v = raw[1:] if raw.startswith("\n") else raw
    v = v[:-1] if v.endswith("\n") else v
    schema = schema if isinstance(schema, dict) else {}
    if not schema or _is_string(schema):
        return v
    try:
        return json.loads(v)
    except ValueError:
        return v


# ------------------------------------------------------------------------------------------------- the parser

class CallParser:
    """Streaming parser of one answer: feed(text) and finish() give Events. Deterministic in the text alone (how it
    is cut into pieces does not matter)."""

    def __init__(self, fmt: ToolFormat, tools: list[dict] | None = None):
        self.fmt = fmt
        self.params = {t["function"]["name"]: (t["function"].get("parameters") or {}) for t in (tools or [])
                       if isinstance(t, dict) and isinstance(t.get("function"), dict) and "name" in t["function"]}
        self.buf = ""
        self.block = None
        self.at_start = True              # no content but whitespace yet
        self.n_calls = 0
        self._out: list[Event] = []

    # -- interface
    def feed(self, text: str) -> list[Event]:
        self.buf += text
        self._run(False)
        return self._take()

    def finish(self) -> list[Event]:
        self._run(True)
        if self.buf:
            self.content(self.buf)
            self.buf = ""
        return self._take()

    # -- used by the block readers
    def content(self, text: str) -> None:
        if text:
            if text.strip():
                self.at_start = False
            self._out.append(Event("content", text))

    def announce(self, name: str) -> int:
        i = self.n_calls
        self.n_calls += 1
        self._out.append(Event("call", index=i, id=self.fmt.new_id(), name=name))
        return i

    def args(self, index: int, text: str) -> None:
        if text:
            self._out.append(Event("args", text, index=index))

    def consume(self, n: int) -> str:
        head, self.buf = self.buf[:n], self.buf[n:]
        return head

    # -- the loop
    def _take(self) -> list[Event]:
        out, self._out = _merge(self._out), []
        return out

    def _run(self, final: bool) -> None:
        while True:
            if self.block is None:
                if not self.buf:
                    return
                i, reader = self.fmt.find(self.buf, self.at_start)
                if reader is None:
                    n = len(self.buf) if final else i
                    self.content(self.consume(n))
                    return
                self.content(self.consume(i))
                self.block = reader
            r = self.block.step(self, final)
            if r == MORE:
                return
            self.block = None
            if isinstance(r, int):                   # rejected: that much text is content after all
                self.content(self.consume(max(1, r)))


def _merge(events: list[Event]) -> list[Event]:
    out: list[Event] = []
    for e in events:
        if out and e.kind in ("content", "args") and out[-1].kind == e.kind and out[-1].index == e.index:
            out[-1] = Event(e.kind, out[-1].text + e.text, index=e.index)
        else:
            out.append(e)
    return out


DONE = "done"


class _JsonCall:
    """One JSON call object at the front of the parser's buffer, {"name": N, "arguments" | "parameters": A}: named
    once "name" and the arguments' key are read (in that order), its arguments streamed as raw JSON text as they
    arrive (a JSON string of arguments is decoded whole); other key orders wait for the whole object."""

    def __init__(self):
        self.phase = "head"
        self.index = -1
        self.scan: ValueEnd | None = None
        self.seen = 0
        self.str_args = False

    def head(self, p: CallParser, j: int, final: bool):
        """Read the header at p.buf[j:] (the text before j belongs to the block and is consumed with it) -> OK
        (named, header consumed), MORE or NO."""
        st, k = expect(p.buf, j, ("{",))
        if st != OK:
            return st
        st, key, k2 = string_at(p.buf, skip_ws(p.buf, k), 64)
        if st == OK and key == "type":                          # {"type": "function", "name": ...}
            st, k3 = expect(p.buf, k2, (":", '"function"', ","))
            if st != OK:
                return st if st == MORE else self._whole(p, j, final)
            st, key, k2 = string_at(p.buf, skip_ws(p.buf, k3), 64)
        if st != OK:
            return st
        if key != "name":
            return self._whole(p, j, final)
        st, k = expect(p.buf, k2, (":",))
        if st != OK:
            return st
        st, name, k = string_at(p.buf, skip_ws(p.buf, k), 256)
        if st != OK:
            return st
        if not isinstance(name, str) or not name:
            return NO
        st, k = expect(p.buf, k, (",",))
        if st != OK:
            return st if st == MORE else self._whole(p, j, final)
        st, key, k = string_at(p.buf, skip_ws(p.buf, k), 64)
        if st != OK:
            return st
        if key not in ("arguments", "parameters"):
            return self._whole(p, j, final)
        st, k = expect(p.buf, k, (":",))
        if st != OK:
            return st
        k = skip_ws(p.buf, k)
        if k >= len(p.buf):
            return MORE
        if p.buf[k] not in '{["':
            return self._whole(p, j, final)
        p.consume(k)
        self.index = p.announce(name)
        self.str_args = p.buf[0] == '"'
        self.scan = ValueEnd()
        self.seen = 0
        self.phase = "args"
        return OK

    def _whole(self, p: CallParser, j: int, final: bool):
        """The object read whole (other key orders): named and given its arguments at once, or NO."""
        if self.scan is None:
            self.scan = ValueEnd()
            self.seen = j
        end = self.scan.feed(p.buf[self.seen:])
        if self.scan.bad:
            return NO
        if end < 0:
            self.seen = len(p.buf)
            return MORE
        end += self.seen
        try:
            obj = json.loads(p.buf[j:end])
        except ValueError:
            return NO
        if not _call_like(obj):
            return NO
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            text = args
        else:
            text = json.dumps(args, ensure_ascii=False)
        p.consume(end)
        i = p.announce(obj["name"])
        p.args(i, text)
        self.phase = "done"
        return OK

    def body(self, p: CallParser, final: bool):
        """After the header: stream the arguments, then skip to the object's closing brace. -> MORE or DONE."""
        if self.phase == "args":
            off = self.seen if self.str_args else 0        # a string of arguments is held whole, then decoded
            end = self.scan.feed(p.buf[off:])
            end = end + off if end >= 0 else end
            if end < 0 and not self.scan.bad:
                if self.str_args:
                    self.seen = len(p.buf)
                    if final:
                        p.args(self.index, _loose_string(p.consume(len(p.buf))))
                        return DONE
                    return MORE
                p.args(self.index, p.consume(len(p.buf)))
                return DONE if final else MORE
            if self.scan.bad:                         # broken JSON: the call ends where it broke
                return DONE
            text = p.consume(end)
            p.args(self.index, _loose_string(text) if self.str_args else text)
            self.phase = "tail"
            self.scan = None
        if self.phase == "tail":
            st, k = expect(p.buf, 0, ("}",))
            if st == OK:
                p.consume(k)
                self.phase = "done"
                return DONE
            if st == MORE:
                return DONE if final else MORE
            st, k = expect(p.buf, 0, (",",))
            if st != OK:                               # something else: the call ends here
                return DONE
            if self.scan is None:                      # further keys: skip to the closing brace
                self.scan = ValueEnd()
                self.scan.started, self.scan.stack = True, ["}"]
                self.seen = 0
            end = self.scan.feed(p.buf[self.seen:])
            if end < 0 and not self.scan.bad:
                self.seen = len(p.buf)
                return DONE if final else MORE
            if end >= 0:
                p.consume(self.seen + end)
            self.phase = "done"
        return DONE


def _closing(p: CallParser, tag: str, final: bool):
    """An optional closing tag after a call (whitespace before it): consumed when there (or begun at the end)."""
    st, k = expect(p.buf, 0, (tag,))
    if st == OK or (st == MORE and final):
        p.consume(k if st == OK else len(p.buf))
        return DONE
    return MORE if st == MORE else DONE


def _args_form_pending(s: str) -> bool:
    """Whether s may still become NAME[ARGS] or NAME[CALL_ID]id[ARGS] (Mistral's v11 form)."""
    rest = s[re.match(r"[A-Za-z0-9_.\-]{0,64}", s).end():]
    if not rest or "[CALL_ID]".startswith(rest) or "[ARGS]".startswith(rest):
        return True
    if rest.startswith("[CALL_ID]"):
        r2 = rest[len("[CALL_ID]"):]
        tail = r2[re.match(r"[A-Za-z0-9]{0,64}", r2).end():]
        return "[ARGS]".startswith(tail)
    return False


def _call_like(obj) -> bool:
    """A JSON call object: a non-empty string "name", and nothing but "arguments" / "parameters" (an object or a
    JSON string), "type" and "id" beside it."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return False
    if set(obj) - {"name", "arguments", "parameters", "type", "id"}:
        return False
    args = obj.get("arguments", obj.get("parameters", {}))
    return isinstance(args, (dict, str))


def _loose_string(text: str) -> str:
    """A JSON string's value; for one cut short, the characters it has."""
    try:
        v = json.loads(text)
        return v if isinstance(v, str) else text
    except ValueError:
        return StringChars().feed(text[1:])[0] if text.startswith('"') else text


class _TagBlock:
    """<tool_call> ... </tool_call>: a JSON call object (hermes) or <function=N> with <parameter=P> children
    (qwen_xml)."""

    def __init__(self, marker: str):
        self.marker = marker
        self.phase = "head"
        self.obj = _JsonCall()
        self.index = -1
        self.n_params = 0

    def step(self, p: CallParser, final: bool):
        while True:
            if self.phase == "head":
                j = skip_ws(p.buf, len(self.marker))
                if j >= len(p.buf):
                    return len(self.marker) if final else MORE
                if p.buf[j] == "{":
                    r = self.obj.head(p, j, final)
                    if r == OK:
                        self.phase = "json"
                        continue
                    return len(self.marker) if r == NO or final else MORE
                st, k = expect(p.buf, j, ("<function=",))
                if st == MORE:
                    return len(self.marker) if final else MORE
                if st == NO:
                    return len(self.marker)
                m = re.match(r"([^>\n<]{1,128})>", p.buf[k:])
                if m is None:
                    pending = len(p.buf) - k < 129 and re.fullmatch(r"[^>\n<]*", p.buf[k:]) is not None
                    return MORE if pending and not final else len(self.marker)
                p.consume(k + m.end())
                self.index = p.announce(m.group(1).strip())
                self.fn = m.group(1).strip()
                self.phase = "params"
            elif self.phase == "json":
                r = self.obj.body(p, final)
                if r == MORE:
                    return MORE
                self.phase = "close"
            elif self.phase == "params":
                j = skip_ws(p.buf, 0)
                st, k = expect(p.buf, j, ("<parameter=",))
                if st == OK:
                    m = re.match(r"([^>\n<]{1,128})>", p.buf[k:])
                    if m is None:
                        if final:
                            return self._close_args(p)
                        return MORE
                    vstart = k + m.end()
                    e = p.buf.find("</parameter>", vstart)
                    if e < 0:
                        if not final:
                            return MORE
                        e = len(p.buf)
                    pname = m.group(1).strip()
                    value = xml_value(p.buf[vstart:e], self._schema(p, pname))
                    frag = ("{" if self.n_params == 0 else ", ") + json.dumps(pname, ensure_ascii=False) + ": " \
                        + json.dumps(value, ensure_ascii=False)
                    p.args(self.index, frag)
                    self.n_params += 1
                    p.consume(min(len(p.buf), e + len("</parameter>")))
                    continue
                st2, k2 = expect(p.buf, j, ("</function>",))
                if st2 == OK:
                    p.consume(k2)
                    self._close_args(p)
                    self.phase = "close"
                    continue
                if (st == MORE or st2 == MORE) and not final:
                    return MORE
                return self._close_args(p)
            else:                                          # close: an optional </tool_call>
                return _closing(p, "</tool_call>", final)

    def _schema(self, p: CallParser, pname: str):
        params = p.params.get(self.fn)
        props = params.get("properties") if isinstance(params, dict) else None
        return props.get(pname) if isinstance(props, dict) else None

    def _close_args(self, p: CallParser):
        p.args(self.index, "}" if self.n_params else "{}")
        return DONE


class _Llama3Block:
    """Llama 3.x JSON calls: after <|python_tag|> or at the start of the answer, one or more call objects
    separated by ';'."""

    def __init__(self, marker: str):
        self.marker = marker
        self.phase = "head"
        self.obj = _JsonCall()
        self.first = True

    def step(self, p: CallParser, final: bool):
        while True:
            if self.phase == "head":
                j = skip_ws(p.buf, len(self.marker)) if self.first else 0
                if j >= len(p.buf):
                    return max(1, len(self.marker)) if final else MORE
                r = self.obj.head(p, j, final)
                if r == OK:
                    self.phase = "body"
                    self.first = False
                    continue
                return max(1, len(self.marker)) if r == NO or final else MORE
            if self.phase == "body":
                if self.obj.body(p, final) == MORE:
                    return MORE
                self.phase = "sep"
            if self.phase == "sep":
                st, k = expect(p.buf, 0, (";",))
                if st == OK:
                    p.consume(k)
                j = skip_ws(p.buf, 0)
                if j >= len(p.buf):
                    return DONE if final else MORE
                if p.buf[j] != "{":
                    return DONE
                p.consume(j)
                self.obj = _JsonCall()
                self.phase = "head"
                self.marker = ""


class _MistralBlock:
    """[TOOL_CALLS] followed by a JSON array of call objects, or by NAME[ARGS]{...} (NAME[CALL_ID]id[ARGS]{...})."""

    def __init__(self, marker: str):
        self.marker = marker
        self.phase = "head"
        self.obj = _JsonCall()
        self.index = -1
        self.scan: ValueEnd | None = None

    def step(self, p: CallParser, final: bool):
        while True:
            if self.phase == "head":
                j = skip_ws(p.buf, len(self.marker))
                if j >= len(p.buf):
                    return len(self.marker) if final else MORE
                if p.buf[j] == "[":
                    r = self.obj.head(p, skip_ws(p.buf, j + 1), final)
                    if r == OK:
                        self.phase = "item"
                        continue
                    return len(self.marker) if r == NO or final else MORE
                m = re.match(r"([A-Za-z0-9_.\-]{1,64})(\[CALL_ID\][A-Za-z0-9]{0,64})?\[ARGS\]", p.buf[j:])
                if m is None:
                    return MORE if _args_form_pending(p.buf[j:]) and not final else len(self.marker)
                p.consume(j + m.end())
                self.index = p.announce(m.group(1))
                self.scan = ValueEnd()
                self.phase = "args"
            elif self.phase == "item":
                if self.obj.body(p, final) == MORE:
                    return MORE
                st, k = expect(p.buf, 0, (",",))
                if st == OK:
                    j = skip_ws(p.buf, k)
                    if j >= len(p.buf) and not final:
                        return MORE
                    self.obj = _JsonCall()
                    r = self.obj.head(p, j, final)
                    if r == MORE and not final:
                        return MORE
                    if r != OK:
                        p.consume(k)
                        return DONE
                    continue
                return _closing(p, "]", final)
            else:                                          # args of the NAME[ARGS] form
                end = self.scan.feed(p.buf)
                if end < 0:
                    p.args(self.index, p.consume(len(p.buf)))
                    return DONE if final or self.scan.bad else MORE
                p.args(self.index, p.consume(end))
                return DONE


class _GenericBlock:
    """The generic JSON answer: {"tool_calls": [calls]}, {"tool_call": call} or {"response": "text"} (streamed);
    any other JSON object is content."""

    def __init__(self):
        self.phase = "head"
        self.obj = _JsonCall()
        self.chars: StringChars | None = None
        self.scan: ValueEnd | None = None
        self.seen = 0

    def step(self, p: CallParser, final: bool):
        while True:
            if self.phase == "head":
                st1, k1 = expect(p.buf, 0, ("{", '"tool_calls"', ":", "["))
                st2, k2 = expect(p.buf, 0, ("{", '"response"', ":", '"'))
                st3, k3 = expect(p.buf, 0, ("{", '"tool_call"', ":"))
                if st1 == OK:
                    j = skip_ws(p.buf, k1)
                    if j >= len(p.buf):
                        return self._whole(p, final) if final else MORE
                    if p.buf[j] == "]":
                        p.consume(j + 1)
                        self.phase = "end"
                        continue
                    r = self.obj.head(p, j, final)
                    if r == OK:
                        self.phase = "item"
                        continue
                    return self._whole(p, final) if r == NO or final else MORE
                if st3 == OK:
                    r = self.obj.head(p, skip_ws(p.buf, k3), final)
                    if r == OK:
                        self.phase = "single"
                        continue
                    return self._whole(p, final) if r == NO or final else MORE
                if st2 == OK:
                    p.consume(k2)
                    self.chars = StringChars()
                    self.phase = "response"
                    continue
                if MORE in (st1, st2, st3) and not final:
                    return MORE
                return self._whole(p, final)
            if self.phase == "response":
                text, end = self.chars.feed(p.buf)
                if self.chars.bad:
                    return DONE
                p.content(text)
                if end < 0:
                    p.consume(len(p.buf))
                    return DONE if final else MORE
                p.consume(end)
                self.phase = "end"
            elif self.phase in ("item", "single"):
                if self.obj.body(p, final) == MORE:
                    return MORE
                if self.phase == "single":
                    self.phase = "end"
                    continue
                st, k = expect(p.buf, 0, (",",))
                if st == OK:
                    j = skip_ws(p.buf, k)
                    if j >= len(p.buf) and not final:
                        return MORE
                    self.obj = _JsonCall()
                    r = self.obj.head(p, j, final)
                    if r == MORE and not final:
                        return MORE
                    if r != OK:
                        return DONE
                    continue
                st, k = expect(p.buf, 0, ("]",))
                if st == MORE and not final:
                    return MORE
                if st == OK:
                    p.consume(k)
                self.phase = "end"
            else:                                          # end: the rest of the object, skipped
                if self.scan is None:
                    self.scan = ValueEnd()
                    self.scan.started, self.scan.stack = True, ["}"]
                    self.seen = 0
                end = self.scan.feed(p.buf[self.seen:])
                if end < 0 and not self.scan.bad:
                    self.seen = len(p.buf)
                    if final:
                        p.consume(len(p.buf))
                        return DONE
                    return MORE
                if end >= 0:
                    p.consume(self.seen + end)
                return DONE

    def _whole(self, p: CallParser, final: bool):
        """Not the usual layout: the whole object, if it is one, read as a generic answer; else content."""
        if self.scan is None:
            self.scan = ValueEnd()
            self.seen = 0
        end = self.scan.feed(p.buf[self.seen:])
        self.seen = len(p.buf) if end < 0 else self.seen + end
        if end < 0:
            return len(p.buf) if self.scan.bad or final else MORE
        try:
            obj = json.loads(p.buf[:self.seen])
        except ValueError:
            return self.seen
        if isinstance(obj, dict) and isinstance(obj.get("response"), str):
            p.consume(self.seen)
            p.content(obj["response"])
            return DONE
        calls = obj.get("tool_calls") if isinstance(obj, dict) else None
        if isinstance(obj, dict) and isinstance(obj.get("tool_call"), dict):
            calls = [obj["tool_call"]]
        if isinstance(calls, list) and calls and all(_call_like(c) for c in calls):
            p.consume(self.seen)
            for c in calls:
                args = c.get("arguments", c.get("parameters", {}))
                i = p.announce(c["name"])
                p.args(i, args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))
            return DONE
        return self.seen


def assemble(events: list[Event]) -> tuple[str, list[dict]]:
    """Events -> (content text, [{"id", "type", "function": {"name", "arguments"}}]) as a non-streamed message has
    them."""
    content: list[str] = []
    calls: list[dict] = []
    for e in events:
        if e.kind == "content":
            content.append(e.text)
        elif e.kind == "call":
            calls.append({"id": e.id, "type": "function", "function": {"name": e.name, "arguments": ""}})
        else:
            calls[e.index]["function"]["arguments"] += e.text
    return "".join(content), calls


def parse(text: str, fmt: ToolFormat, tools: list[dict] | None = None) -> tuple[str, list[dict]]:
    """A whole answer -> (content, calls)."""
    p = fmt.parser(tools)
    return assemble(p.feed(text) + p.finish())
