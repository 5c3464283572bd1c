"""Reading tool calls out of an answer as it streams: the parser (CallParser) that runs the readers of a call format
(strata.tool_readers, over strata.tool_json's JSON call object) and the events it gives.

The readers decide from the text alone, never from how it was cut into pieces, so a whole answer fed in one piece
and the same answer streamed give the same events. A call is named as soon as its name and the start of its
arguments are read, and its arguments stream as they arrive; text that turns out not to be a call before that comes
back as content, unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass

from strata.json_stream import MORE
# the readers, re-exported from their own module (strata.tool_readers) for the callers of this one
from strata.tool_readers import GenericBlock, Llama3Block, MistralBlock, TagBlock, is_string, xml_value

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
    is cut into pieces does not matter). fmt: a strata.tool_calls.ToolFormat (its find() gives the readers of its
    call blocks, its new_id() the calls' ids); tools: the request's tools (the XML format types values by them)."""

    def __init__(self, fmt, tools: list[dict] | None = None):
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
