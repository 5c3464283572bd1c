"""ContentShape: a client string as the sentinel method gives it to a template that reads strings (strips, trims,
splits or tests them): its leading and trailing whitespace and the literal markers the template looks for stay as
they are around sentinels of the rest; the proof, from the tokenizer's special tokens, that those literal parts
tokenize as they would as plain text; and SentinelRendering, which marks the sentinels a template's tojson escapes
(a tool call's arguments given as a JSON string)."""
from __future__ import annotations

import json
import re

import jinja2
import jinja2.nodes as nodes

__all__ = ["ContentShape", "SENTINELS", "SentinelRendering", "content_shape", "sentinel_string", "string_markers"]

#: the variable a sentinel rendering gets (a SentinelRendering)
SENTINELS = "strata_sentinels"

#: str methods whose result depends on where a constant string occurs in the string (its first argument)
_MARKER_METHODS = frozenset({"split", "rsplit", "startswith", "endswith", "replace", "find", "rfind", "index",
                             "rindex", "count", "partition", "rpartition", "removeprefix", "removesuffix"})
#: str methods and filters whose result depends on the string's leading / trailing whitespace
_EDGE_METHODS = frozenset({"strip", "lstrip", "rstrip"})
_EDGE_FILTERS = frozenset({"trim"})


def string_markers(env: jinja2.Environment, source: str) -> frozenset[str] | None:
    """The string constants the template looks for in strings (the first argument of split / startswith / endswith
    / replace / find / ... calls and of the `replace` filter, the left operand of `in` / `not in`); None when the
    template reads no string that way and strips or trims none (its output then holds a client string whole, or
    not at all)."""
    try:
        tree = env.parse(source)
    except jinja2.TemplateError:
        return None
    found: set[str] = set()
    reads = False
    for call in tree.find_all(nodes.Call):
        if isinstance(call.node, nodes.Getattr):
            if call.node.attr in _MARKER_METHODS:
                reads = True
                if call.args and isinstance(call.args[0], nodes.Const) and isinstance(call.args[0].value, str):
                    found.add(call.args[0].value)
            elif call.node.attr in _EDGE_METHODS:
                reads = True
    for f in tree.find_all(nodes.Filter):
        if f.name in _EDGE_FILTERS:
            reads = True
        elif f.name == "replace":
            reads = True
            if f.args and isinstance(f.args[0], nodes.Const) and isinstance(f.args[0].value, str):
                found.add(f.args[0].value)
    for cmp in tree.find_all(nodes.Compare):
        if any(o.op in ("in", "notin") for o in cmp.ops) and isinstance(cmp.expr, nodes.Const) and \
                isinstance(cmp.expr.value, str):
            reads = True
            found.add(cmp.expr.value)
    if not reads:
        return None
    return frozenset(m for m in found if m)


def _overlaps(a: str, b: str) -> bool:
    """Some non-empty suffix of a is a proper prefix of b, or a non-empty suffix of b a proper prefix of a."""
    for x, y in ((a, b), (b, a)):
        for k in range(1, min(len(x), len(y))):
            if x.endswith(y[:k]):
                return True
    return False


class ContentShape:
    """Shapes client strings for the sentinel method: a string is cut at each marker it keeps (`markers` but
    `unsafe`; leftmost, longest first); of each piece between them the leading and trailing whitespace
    (str.isspace) stay literal and the rest becomes a sentinel (`sent`); the kept markers stay literal. A
    template's strip / trim / lstrip('\\n') / split('</think>') / startswith('<tool_response>') / `'</think>' in`
    then see in the shaped string what they see in the real one, so the sentinel rendering restored gives the real
    rendering where the template reads strings only that way (the caller checks that it does, string by string).
    An unsafe marker (one the tokenizer could join to template text) stays inside a sentinel: a template that looks
    for it sees it nowhere, and where its output differs for that the check fails."""

    def __init__(self, markers: frozenset[str], unsafe: frozenset[str] = frozenset()):
        self.markers = frozenset(markers) - frozenset(unsafe)
        self.unsafe = frozenset(unsafe)
        alts = sorted(self.markers, key=lambda m: (-len(m), m))
        self._pat = re.compile("|".join(map(re.escape, alts))) if alts else None

    def shape(self, s: str, sent) -> str:
        """`s` shaped, `sent(core)` giving each core's sentinel; `sent(s)` whole when the shaped string does not
        hold each kept marker as often as `s` does, at its start and end alike (a marker that a sentinel's text
        would complete)."""
        cores: list[tuple[int, int]] = []
        pos = 0
        if self._pat is not None:
            for m in self._pat.finditer(s):
                cores.append((pos, m.start()))
                pos = m.end()
        cores.append((pos, len(s)))
        parts: list[str] = []
        for k, (a, b) in enumerate(cores):
            if k:
                parts.append(s[cores[k - 1][1]:a])          # the marker before this piece
            seg = s[a:b]
            lead = len(seg) - len(seg.lstrip())
            if lead == len(seg):
                parts.append(seg)
                continue
            trail = len(seg.rstrip())
            parts += [seg[:lead], sent(seg[lead:trail]), seg[trail:]]
        out = "".join(parts)
        for m in self.markers:
            if out.count(m) != s.count(m) or out.startswith(m) != s.startswith(m) or \
                    out.endswith(m) != s.endswith(m):
                return sent(s)
        return out


def content_shape(markers: frozenset[str] | None, specials) -> ContentShape | None:
    """A ContentShape for a template's `markers` (string_markers) when keeping client whitespace and markers literal
    tokenizes as plain text does, else None. `specials`: (text, user_defined) of the tokenizer's special tokens
    (CONTROL / UNKNOWN ones are recognised only in template text, USER_DEFINED ones in all text, neither across a
    piece boundary). Whitespace may stay literal when no special token's text holds whitespace (none can take in a
    literal client space); a marker when no special token's text overlaps it partly or holds it inside a longer
    text, and no CONTROL / UNKNOWN one occurs in it (the others go to ContentShape.unsafe). Then every
    special token found in the joined template text lies wholly within the template's own text or is a
    USER_DEFINED one wholly within a marker (found in plain text too), and the raw text around them is one fragment
    either way."""
    if markers is None:
        return None
    unsafe = set()
    for text, user_defined in specials:
        if any(c.isspace() for c in text):
            return None
        for m in markers:
            if text == m:
                if not user_defined:
                    unsafe.add(m)
            elif m in text or (text in m and not user_defined) or _overlaps(text, m):
                unsafe.add(m)
    return ContentShape(markers, frozenset(unsafe))


class SentinelRendering:
    """Passed as the variable SENTINELS to a rendering whose client strings hold sentinels of `nonce`: the
    template's tojson marks each sentinel in its output as JSON-escaped (zqx{nonce}[x{j}]s{i}qzx becomes
    ...s{i}juqzx, or ...jaqzx with ensure_ascii), which sentinel_string turns into the escaped client string. JSON
    escapes a string character by character, so the escaped shaped string put back is the escaped real one. A
    client cannot pass one (it is not a JSON value)."""
    __slots__ = ("nonce", "_pat")

    def __init__(self, nonce: str):
        self.nonce = nonce
        self._pat = re.compile(re.escape(f"zqx{nonce}") + r"((?:x[0-9]+)?s[0-9]+)qzx")

    def escaped(self, out: str, ensure_ascii: bool) -> str:
        """tojson's output `out` with its sentinels marked as escaped."""
        if f"zqx{self.nonce}" not in out:
            return out
        tag = "ja" if ensure_ascii else "ju"
        return self._pat.sub(lambda m: f"zqx{self.nonce}{m.group(1)}{tag}qzx", out)


def sentinel_string(key: str, table) -> str | None:
    """The client text a sentinel `key` found in a sentinel rendering stands for (`table`: .get of sentinel ->
    string): the string, or its JSON escape for a key SentinelRendering marked; None for a key the table lacks."""
    if key.endswith(("juqzx", "jaqzx")):
        s = table.get(key[:-5] + "qzx")
        return None if s is None else json.dumps(s, ensure_ascii=key[-4] == "a")[1:-1]
    return table.get(key)
