"""Reasoning in model output: the <think>…</think> part split from the answer, whole and streamed (llama.cpp's server and vLLM return it as reasoning_content)."""
from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def template_thinks(template_source: str | None) -> bool:
    """Whether a chat template knows reasoning blocks (it writes <think> somewhere: Qwen3, Qwen3.5, DeepSeek-R1)."""
    return OPEN in (template_source or "")


def _ends_with(text: str, tag: str) -> bool:
    """text.rstrip().endswith(tag) without copying the text (a prompt may be megabytes; its tail is what counts)."""
    end = len(text)
    while end and text[end - 1].isspace():
        end -= 1
    return text.endswith(tag, 0, end)


def prompt_opens(prompt_text: str) -> bool:
    """Whether the rendered prompt leaves a reasoning block open (the generation prompt ends in <think>, as Qwen3.5's
    and DeepSeek-R1's templates write it): the answer then starts inside it."""
    return _ends_with(prompt_text, OPEN)


def prompt_closes(prompt_text: str) -> bool:
    """Whether the rendered prompt ends with a closed (empty) reasoning block, as Qwen3's template writes it when
    enable_thinking is false: the answer then has none."""
    return _ends_with(prompt_text, CLOSE)


def _hold(buf: str, tag: str) -> int:
    """Length of the longest tail of buf that is a proper prefix of tag."""
    for k in range(min(len(tag) - 1, len(buf)), 0, -1):
        if buf.endswith(tag[:k]):
            return k
    return 0


class ReasoningSplit:
    """Splits an answer into ("reasoning", text) and ("content", text) pieces as it streams. The reasoning block is
    either opened by the prompt (opened=True) or by <think> at the very start of the answer (after whitespace); it
    ends at </think> (an answer that ends first is all reasoning). Text after it, and answers that do not start
    with one, are content. Deterministic in the text alone (how it is cut into pieces does not matter)."""

    def __init__(self, opened: bool = False):
        self.state = "think" if opened else "start"
        self.buf = ""

    def feed(self, text: str) -> list[tuple[str, str]]:
        self.buf += text
        out: list[tuple[str, str]] = []
        while self.buf:
            if self.state == "start":
                s = self.buf.lstrip()
                if s.startswith(OPEN):
                    self.buf = s[len(OPEN):]
                    self.state = "think"
                    continue
                if OPEN.startswith(s):               # whitespace, or the start of <think>: not decided yet
                    break
                self.state = "content"
            if self.state == "think":
                i = self.buf.find(CLOSE)
                if i >= 0:
                    out.append(("reasoning", self.buf[:i]))
                    self.buf = self.buf[i + len(CLOSE):]
                    self.state = "content"
                    continue
                k = len(self.buf) - _hold(self.buf, CLOSE)
                out.append(("reasoning", self.buf[:k]))
                self.buf = self.buf[k:]
                break
            out.append(("content", self.buf))
            self.buf = ""
        return [(c, t) for c, t in out if t]

    def finish(self) -> list[tuple[str, str]]:
        rest, self.buf = self.buf, ""
        if not rest:
            return []
        return [("reasoning" if self.state == "think" else "content", rest)]
