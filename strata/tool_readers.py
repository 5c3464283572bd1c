"""The tool-call readers, one per call format: <tool_call> blocks with a JSON or an XML body (TagBlock), Llama 3 JSON
(Llama3Block), Mistral's two forms (MistralBlock), the generic JSON answer (GenericBlock); the XML format's values."""
from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING

from strata.json_stream import MORE, NO, OK, StringChars, ValueEnd, expect, skip_ws
from strata.tool_json import DONE, JsonCall, call_like, closing, next_call, skip_rest

if TYPE_CHECKING:
    from strata.tool_parse import CallParser


def is_string(schema: dict) -> bool:
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
    if not schema or is_string(schema):
        return v
    try:
        return json.loads(v)
    except ValueError:
        return v


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


class TagBlock:
    """<tool_call> ... </tool_call>: a JSON call object (hermes) or <function=N> with <parameter=P> children
    (qwen_xml)."""

    def __init__(self, marker: str):
        self.marker = marker
        self.phase = "head"
        self.obj = JsonCall()
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
                return closing(p, "</tool_call>", final)

    def _schema(self, p: CallParser, pname: str):
        params = p.params.get(self.fn)
        props = params.get("properties") if isinstance(params, dict) else None
        return props.get(pname) if isinstance(props, dict) else None

    def _close_args(self, p: CallParser):
        p.args(self.index, "}" if self.n_params else "{}")
        return DONE


class Llama3Block:
    """Llama 3.x JSON calls: after <|python_tag|> or at the start of the answer, one or more call objects
    separated by ';'."""

    def __init__(self, marker: str):
        self.marker = marker
        self.phase = "head"
        self.obj = JsonCall()
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
                self.obj = JsonCall()
                self.phase = "head"
                self.marker = ""


class MistralBlock:
    """[TOOL_CALLS] followed by a JSON array of call objects, or by NAME[ARGS]{...} (NAME[CALL_ID]id[ARGS]{...})."""

    def __init__(self, marker: str):
        self.marker = marker
        self.phase = "head"
        self.obj = JsonCall()
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
                r, k = next_call(self, p, final)
                if r == MORE:
                    return MORE
                if r == OK:
                    continue
                if r == NO:
                    p.consume(k)
                    return DONE
                return closing(p, "]", final)
            else:                                          # args of the NAME[ARGS] form
                end = self.scan.feed(p.buf)
                if end < 0:
                    p.args(self.index, p.consume(len(p.buf)))
                    return DONE if final or self.scan.bad else MORE
                p.args(self.index, p.consume(end))
                return DONE


class GenericBlock:
    """The generic JSON answer: {"tool_calls": [calls]}, {"tool_call": call} or {"response": "text"} (streamed);
    any other JSON object is content."""

    def __init__(self):
        self.phase = "head"
        self.obj = JsonCall()
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
                r, _ = next_call(self, p, final)
                if r == MORE:
                    return MORE
                if r == OK:
                    continue
                if r == NO:
                    return DONE
                st, k = expect(p.buf, 0, ("]",))
                if st == MORE and not final:
                    return MORE
                if st == OK:
                    p.consume(k)
                self.phase = "end"
            else:                                          # end: the rest of the object, skipped
                if skip_rest(self, p):
                    return DONE
                if final:
                    p.consume(len(p.buf))
                    return DONE
                return MORE

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
        if isinstance(calls, list) and calls and all(call_like(c) for c in calls):
            p.consume(self.seen)
            for c in calls:
                args = c.get("arguments", c.get("parameters", {}))
                i = p.announce(c["name"])
                p.args(i, args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))
            return DONE
        return self.seen

