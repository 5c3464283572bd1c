"""One JSON tool-call object read as it streams (JsonCall), and the steps the call-format readers share: the next
call of a JSON array, the rest of an object skipped, an optional closing tag, what counts as a call object."""
from __future__ import annotations

import json
from typing import TYPE_CHECKING

from strata.json_stream import MORE, NO, OK, StringChars, ValueEnd, expect, skip_ws, string_at

if TYPE_CHECKING:
    from strata.tool_parse import CallParser

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

