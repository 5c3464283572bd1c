"""A one-choice chat answer as blocks (reasoning, text, tool call), for the Responses and Messages routes."""
from __future__ import annotations

from dataclasses import dataclass

from strata.engine.types import FinalEvent
from strata.serve.handling import next_event


@dataclass
class Block:
    """One block of an answer: kind "reasoning", "text" or "call"; index: its position among the answer's blocks;
    text: its text, reasoning or call arguments (a JSON string) so far; call_id and name for a call."""
    kind: str
    index: int
    text: str = ""
    call_id: str | None = None
    name: str | None = None


class AnswerBlocks:
    """The deltas of a structured.Answer (content / reasoning_content / tool_calls, as the chat route streams them)
    cut into blocks: a block opens where the channel or the call changes and closes where the next one opens or the
    answer ends. events(job) yields ("start", block, ""), ("delta", block, text), ("stop", block, "") as the answer
    comes; afterwards `blocks`, `final` (the engine's FinalEvent), `finish_reason` (the chat route's: "tool_calls" for
    an answer with calls that ended on its own) and `reasoning_tokens` (generated tokens that wrote reasoning) hold
    the whole answer, the same whether it was streamed or not."""

    def __init__(self, answer):
        self.answer = answer
        self.blocks: list[Block] = []
        self.final = None
        self.finish_reason: str | None = None
        self.reasoning_tokens = 0
        self._open: Block | None = None
        self._calls: dict[int, Block] = {}

    async def events(self, job):
        while True:
            ev = await next_event(job)
            if isinstance(ev, FinalEvent):
                deltas = self.answer.feed(ev.text or "") + self.answer.finish(self.answer.cut_by(ev))
                out = self._feed(deltas) + self._close()
                self.final, self.finish_reason = ev, self.answer.finish_reason(ev.finish_reason)
                for e in out:
                    yield e
                return
            deltas = self.answer.feed(ev.text)
            self.reasoning_tokens += any("reasoning_content" in d for d in deltas)
            for e in self._feed(deltas):
                yield e

    def _feed(self, deltas: list[dict]) -> list[tuple[str, Block, str]]:
        out: list[tuple[str, Block, str]] = []
        for d in deltas:
            if d.get("reasoning_content"):
                self._text("reasoning", d["reasoning_content"], out)
            elif d.get("content"):
                self._text("text", d["content"], out)
            for tc in d.get("tool_calls") or []:
                if tc.get("id") is not None:          # a call starts: its id and name, arguments to follow
                    out += self._close()
                    b = self._start("call", out)
                    b.call_id, b.name = tc["id"], tc["function"]["name"]
                    self._calls[tc["index"]] = b
                frag = tc["function"].get("arguments") or ""
                if frag:
                    b = self._calls[tc["index"]]
                    b.text += frag
                    out.append(("delta", b, frag))
        return out

    def _text(self, kind: str, text: str, out: list) -> None:
        b = self._open
        if b is None or b.kind != kind:
            out += self._close()
            b = self._start(kind, out)
        b.text += text
        out.append(("delta", b, text))

    def _start(self, kind: str, out: list) -> Block:
        b = Block(kind, len(self.blocks))
        self.blocks.append(b)
        self._open = b
        out.append(("start", b, ""))
        return b

    def _close(self) -> list[tuple[str, Block, str]]:
        b, self._open = self._open, None
        return [("stop", b, "")] if b is not None else []

    def text(self) -> str:
        """The answer's text blocks joined."""
        return "".join(b.text for b in self.blocks if b.kind == "text")
