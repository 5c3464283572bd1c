"""Reading tool calls out of an answer as it streams: the parser (CallParser), the reader of each call format
(<tool_call> blocks with a JSON or an XML body: TagBlock; Llama 3 JSON: Llama3Block; Mistral's two forms:
MistralBlock; the generic JSON answer: GenericBlock), the JSON call object they read (JsonCall) and the steps they
share.

The readers decide from the text alone, never from how it was cut into pieces, so a whole answer fed in one piece
and the same answer streamed give the same events. A call is named as soon as its name and the start of its
arguments are read, and its arguments stream as they arrive; text that turns out not to be a call before that comes
back as content, unchanged.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from strata.structured.json_stream import MORE, NO, OK, StringChars, ValueEnd, expect, skip_ws, string_at


DONE = "done"


class JsonCall:
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
        if not call_like(obj):
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
                        p.args(self.index, loose_string(p.consume(len(p.buf))))
                        return DONE
                    return MORE
                p.args(self.index, p.consume(len(p.buf)))
                return DONE if final else MORE
            if self.scan.bad:                         # broken JSON: the call ends where it broke
                return DONE
            text = p.consume(end)
            p.args(self.index, loose_string(text) if self.str_args else text)
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
            if not skip_rest(self, p):                 # further keys: skip to the closing brace
                return DONE if final else MORE
            self.phase = "done"
        return DONE


def drop_rest(p: CallParser):
    """The answer was cut off (CallParser.finish(cut=True)) inside a call block before its call was named (or inside
    a generic answer's header): what is left is a call the cut left unnamed, dropped, not content. -> DONE."""
    p.consume(len(p.buf))
    return DONE


_CALL_KEYS = ("name", "arguments", "parameters", "type", "id")
_FIRST_KEY = re.compile(r'\{\s*(?:"((?:[^"\\]|\\.)*)("?))?\s*$')


def may_be_call(text: str) -> bool:
    """Whether text, a JSON object cut off at its end, may still be a call object: it has no key yet, or its first
    key is (the start of) one a call object has (call_like). Read only when the answer was cut."""
    m = _FIRST_KEY.match(text)
    if m is None:                                     # past the first key: its name decides
        m2 = re.match(r'\{\s*"((?:[^"\\]|\\.)*)"', text)
        return m2 is not None and m2.group(1) in _CALL_KEYS
    key, closed = m.group(1), m.group(2)
    if key is None:
        return True
    return key in _CALL_KEYS if closed else any(k.startswith(key) for k in _CALL_KEYS)


def closing(p: CallParser, tag: str, final: bool):
    """An optional closing tag after a call (whitespace before it): consumed when there (or begun at the end)."""
    st, k = expect(p.buf, 0, (tag,))
    if st == OK or (st == MORE and final):
        p.consume(k if st == OK else len(p.buf))
        return DONE
    return MORE if st == MORE else DONE


def skip_rest(block, p: CallParser) -> bool:
    """Skip the rest of an object whose opening brace is behind (its closing brace included), scanned by block.scan
    from block.seen (both set up on the first call) -> True when done (consumed through the brace, or nothing
    consumed when the JSON broke), False when the object goes on past the buffer (block.seen moved to its end)."""
    if block.scan is None:
        block.scan = ValueEnd()
        block.scan.started, block.scan.stack = True, ["}"]
        block.seen = 0
    end = block.scan.feed(p.buf[block.seen:])
    if end < 0 and not block.scan.bad:
        block.seen = len(p.buf)
        return False
    if end >= 0:
        p.consume(block.seen + end)
    return True


def next_call(block, p: CallParser, final: bool):
    """After a call of a JSON array of calls: a ',' and the next call object's header, read by a fresh JsonCall that
    becomes block.obj -> (OK: named, MORE, or NO: no call follows after all; k: where the ',' ends), or (None, 0)
    when no ',' follows."""
    st, k = expect(p.buf, 0, (",",))
    if st != OK:
        return None, 0
    j = skip_ws(p.buf, k)
    if j >= len(p.buf) and not final:
        return MORE, k
    block.obj = JsonCall()
    r = block.obj.head(p, j, final)
    if r == MORE and not final:
        return MORE, k
    return (OK if r == OK else NO), k


def call_like(obj) -> bool:
    """A JSON call object: a non-empty string "name", and nothing but "arguments" / "parameters" (an object or a
    JSON string), "type" and "id" beside it."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return False
    if set(obj) - {"name", "arguments", "parameters", "type", "id"}:
        return False
    args = obj.get("arguments", obj.get("parameters", {}))
    return isinstance(args, (dict, str))


def loose_string(text: str) -> str:
    """A JSON string's value; for one cut short, the characters it has."""
    try:
        v = json.loads(text)
        return v if isinstance(v, str) else text
    except ValueError:
        return StringChars().feed(text[1:])[0] if text.startswith('"') else text


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
                    return (drop_rest(p) if p.cut else len(self.marker)) if final else MORE
                if p.buf[j] == "{":
                    r = self.obj.head(p, j, final)
                    if r == OK:
                        self.phase = "json"
                        continue
                    if final and p.cut and r != NO:      # cut before the call was named: no content
                        return drop_rest(p)
                    return len(self.marker) if r == NO or final else MORE
                st, k = expect(p.buf, j, ("<function=",))
                if st == MORE:
                    return (drop_rest(p) if p.cut else len(self.marker)) if final else MORE
                if st == NO:
                    return len(self.marker)
                m = re.match(r"([^>\n<]{1,128})>", p.buf[k:])
                if m is None:
                    pending = len(p.buf) - k < 129 and re.fullmatch(r"[^>\n<]*", p.buf[k:]) is not None
                    if pending and final and p.cut:
                        return drop_rest(p)
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
                            if p.cut:                           # cut inside a parameter's name: not content
                                p.consume(len(p.buf))
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
                if (st == MORE or st2 == MORE) and p.cut:      # cut inside a tag the format writes: not content
                    p.consume(len(p.buf))
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
                    if final and p.cut and (self.marker or not self.first):
                        return drop_rest(p)       # cut after <|python_tag|> or a ';': a call left unnamed
                    return max(1, len(self.marker)) if final else MORE
                r = self.obj.head(p, j, final)
                if r == OK:
                    self.phase = "body"
                    self.first = False
                    continue
                # cut before the call was named: no content (without the tag, only what may still be a call object)
                if final and p.cut and r != NO and (self.marker or not self.first or may_be_call(p.buf[j:])):
                    return drop_rest(p)
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
                        return self._cut(p) if final and p.cut else self._whole(p, final) if final else MORE
                    if p.buf[j] == "]":
                        p.consume(j + 1)
                        self.phase = "end"
                        continue
                    r = self.obj.head(p, j, final)
                    if r == OK:
                        self.phase = "item"
                        continue
                    if final and p.cut and r != NO:
                        return self._cut(p)
                    return self._whole(p, final) if r == NO or final else MORE
                if st3 == OK:
                    r = self.obj.head(p, skip_ws(p.buf, k3), final)
                    if r == OK:
                        self.phase = "single"
                        continue
                    if final and p.cut and r != NO:
                        return self._cut(p)
                    return self._whole(p, final) if r == NO or final else MORE
                if st2 == OK:
                    p.consume(k2)
                    self.chars = StringChars()
                    self.phase = "response"
                    continue
                if MORE in (st1, st2, st3) and not final:
                    return MORE
                if MORE in (st1, st2, st3) and p.cut:         # cut inside the header of a call list or an answer
                    return self._cut(p)
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
                    return self._cut(p) if final and p.cut else DONE
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

    _cut = staticmethod(drop_rest)

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


__all__ = ["Event", "CallParser", "hold_from", "assemble", "GenericBlock", "Llama3Block", "MistralBlock", "TagBlock",
           "is_string", "xml_value"]


@dataclass(frozen=True)
class Event:
    """A piece of parsed answer: kind "content" (text), "call" (a new call: index, id, name) or "args" (a fragment of
    call `index`'s arguments, JSON text)."""
    kind: str
    text: str = ""
    index: int = 0
    id: str = ""
    name: str = ""


def hold_from(buf: str, markers) -> int:
    """Where the longest tail of buf that could still become one of the markers starts (len(buf): none)."""
    hold = len(buf)
    for m in markers:
        for k in range(min(len(m) - 1, len(buf)), 0, -1):
            if buf.endswith(m[:k]):
                hold = min(hold, len(buf) - k)
                break
    return hold


# ------------------------------------------------------------------------------------------------- the parser

class CallParser:
    """Streaming parser of one answer: feed(text) and finish() give Events. Deterministic in the text alone (how it
    is cut into pieces does not matter). fmt: a strata.structured.tool_calls.ToolFormat (its find() gives the readers of its
    call blocks, its new_id() the calls' ids); tools: the request's tools (the XML format types values by them)."""

    def __init__(self, fmt, tools: list[dict] | None = None):
        self.fmt = fmt
        self.params = {t["function"]["name"]: (t["function"].get("parameters") or {}) for t in (tools or [])
                       if isinstance(t, dict) and isinstance(t.get("function"), dict) and "name" in t["function"]}
        self.buf = ""
        self.block = None
        self.at_start = True              # no content but whitespace yet
        self.n_calls = 0
        self.cut = False                  # finish(cut=True): the answer was cut off (max_tokens)
        self._out: list[Event] = []

    # -- interface
    def feed(self, text: str) -> list[Event]:
        self.buf += text
        self._run(False)
        return self._take()

    def finish(self, cut: bool = False) -> list[Event]:
        """The end of the answer. cut: it was cut off (max_tokens, the context's end), so a call block the cut left
        before its call was named is dropped, not content: a generic JSON answer's unnamed rest of its list of
        calls (or a header cut short), a <tool_call> block (or <|python_tag|>, or a Llama 3 answer's object that may
        still be a call) without its name, a marker's first characters at the very end. The calls named so far
        stay, their arguments as far as they came. Without cut that rest is text that broke the format: content."""
        self.cut = cut
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
                    if final and self.cut:           # a marker's start left at the very end is no content
                        self.content(self.consume(i))
                        self.buf = ""
                        return
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
