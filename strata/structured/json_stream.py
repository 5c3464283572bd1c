"""Reading JSON from text that is still arriving: where a value ends, a string at a position, a literal prefix, a string's characters decoded as they come."""
from __future__ import annotations

import json
import re

MORE, NO, OK = "more", "no", "ok"          # not decidable yet / cannot match / matched
_WS = re.compile(r"[ \t\r\n]*")


def skip_ws(buf: str, i: int) -> int:
    return _WS.match(buf, i).end()


def expect(buf: str, i: int, parts: tuple[str, ...]) -> tuple[str, int]:
    """Match the literals `parts` at buf[i:], JSON whitespace allowed before each: (OK, end) / (MORE, i) when buf
    ends inside a possible match / (NO, i)."""
    j = i
    for part in parts:
        j = skip_ws(buf, j)
        have = buf[j:j + len(part)]
        if have != part:
            return (MORE, i) if part.startswith(have) and j + len(have) == len(buf) else (NO, i)
        j += len(part)
    return OK, j


def string_at(buf: str, i: int, max_len: int = 1 << 16) -> tuple[str, str | None, int]:
    """The JSON string starting at buf[i] ('"'): (OK, its value, end) / (MORE, None, i) / (NO, None, i) (not a
    string, a bad escape, or longer than max_len characters)."""
    if i >= len(buf):
        return MORE, None, i
    if buf[i] != '"':
        return NO, None, i
    j = i + 1
    while True:
        k = buf.find('"', j)
        if k < 0:
            return (MORE if len(buf) - i <= max_len else NO), None, i
        n = 0
        while buf[k - 1 - n] == "\\":
            n += 1
        if n % 2 == 0:
            break
        j = k + 1
    if k - i > max_len:
        return NO, None, i
    try:
        return OK, json.loads(buf[i:k + 1]), k + 1
    except ValueError:
        return NO, None, i


class ValueEnd:
    """Finds where a JSON object, array or string ends as text arrives (nesting, strings and escapes tracked;
    other syntax is left to json.loads once it is whole). feed(text) -> index in text just past the value, or
    -1 (not yet); bad is set by a closing bracket that does not match."""

    def __init__(self):
        self.stack: list[str] = []
        self.in_str = False
        self.esc = False
        self.started = False
        self.bad = False

    def feed(self, text: str) -> int:
        for k, c in enumerate(text):
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif c == "\\":
                    self.esc = True
                elif c == '"':
                    self.in_str = False
                    if not self.stack:
                        return k + 1
                continue
            if not self.started:
                if c in " \t\r\n":
                    continue
                self.started = True
                if c == '"':
                    self.in_str = True
                elif c in "{[":
                    self.stack.append("}" if c == "{" else "]")
                else:
                    self.bad = True
                    return -1
                continue
            if c == '"':
                self.in_str = True
            elif c in "{[":
                self.stack.append("}" if c == "{" else "]")
            elif c in "}]":
                if not self.stack or self.stack.pop() != c:
                    self.bad = True
                    return -1
                if not self.stack:
                    return k + 1
        return -1


class StringChars:
    """Decodes the characters of a JSON string as its text arrives (after the opening quote): feed(text) ->
    (decoded text, index just past the closing quote or -1). An escape split over two pieces is held; a bad escape
    sets bad."""

    def __init__(self):
        self.held = ""
        self.bad = False

    def feed(self, text: str) -> tuple[str, int]:
        s = self.held + text
        off = len(self.held)
        out: list[str] = []
        i = 0
        while i < len(s):
            c = s[i]
            if c == '"':
                self.held = ""
                return "".join(out), i + 1 - off
            if c != "\\":
                j = i
                while j < len(s) and s[j] not in '"\\':
                    j += 1
                out.append(s[i:j])
                i = j
                continue
            if i + 1 >= len(s):
                break
            if s[i + 1] == "u":
                m = re.match(r"\\u([0-9a-fA-F]{4})(\\u([0-9a-fA-F]{4}))?", s[i:])
                if m is None and len(s) - i >= 6:
                    self.bad = True
                    return "".join(out), -1
                if m is None:
                    break
                hi = int(m.group(1), 16)
                if 0xD800 <= hi < 0xDC00:                     # a surrogate pair needs its second half
                    if m.group(2) is None:
                        if len(s) - i < 12:
                            break
                        self.bad = True
                        return "".join(out), -1
                    lo = int(m.group(3), 16)
                    out.append(chr(0x10000 + ((hi - 0xD800) << 10) + (lo - 0xDC00)))
                    i += 12
                else:
                    out.append("\ufffd" if 0xDC00 <= hi < 0xE000 else chr(hi))   # a lone surrogate has no UTF-8
                    i += 6
                continue
            esc = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}.get(s[i + 1])
            if esc is None:
                self.bad = True
                return "".join(out), -1
            out.append(esc)
            i += 2
        self.held = s[i:]
        return "".join(out), -1
