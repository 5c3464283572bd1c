"""Per-token logprobs of an answer in OpenAI's shapes (the chat content list, the legacy completions arrays),
covering exactly the text the answer returns."""
from __future__ import annotations

import codecs
from typing import Any


def token_text(engine, token_id: int) -> str:
    return engine.detokenize([token_id])


def lp_entry(engine, token_id: int, text: str, lp: float) -> dict:
    """One OpenAI logprobs entry: `bytes` are the token's own bytes (so that joining them rebuilds text a character
    of which spans several tokens), not the UTF-8 of its (possibly U+FFFD) text."""
    raw = engine.token_bytes(token_id) if hasattr(engine, "token_bytes") else text.encode("utf-8", "replace")
    return {"token": text, "logprob": lp, "bytes": list(raw)}


class LogprobsAcc:
    """Collects per-token logprobs in the chat format (content list) or the legacy completions format, covering
    exactly the text the answer returns: an entry is held back while its token's text is (a possible stop string
    or an incomplete UTF-8 sequence held back by the engine), released with the text, and dropped if that text
    never comes (the stop string cut from the answer). text_offset: the character offset in the answer where the
    token's text starts (tokens splitting one character share its offset)."""

    def __init__(self, engine, kind: str):
        self.engine, self.kind = engine, kind
        self.content: list[dict] = []
        self.tokens, self.token_logprobs, self.top, self.offsets = [], [], [], []
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._chars = 0                           # characters of all tokens' bytes decoded so far
        self._released = 0                        # characters of the answer released so far
        self._pending: list[tuple[int, Any]] = []  # (offset, entry) not yet covered by released text

    def add(self, ev, emitted: str) -> dict | None:
        """Take one TokenEvent (emitted: the text it released); returns the entries released now, as one chunk's
        logprobs, or None."""
        if ev.logprob is None:
            return None
        text = token_text(self.engine, ev.token_id)
        raw = self.engine.token_bytes(ev.token_id) if hasattr(self.engine, "token_bytes") else text.encode()
        offset = self._chars
        self._chars += len(self._decoder.decode(raw))
        tops = ev.top_logprobs or []
        if self.kind == "chat":
            entry: Any = lp_entry(self.engine, ev.token_id, text, ev.logprob)
            entry["top_logprobs"] = [lp_entry(self.engine, i, t, lp) for (i, t, lp) in tops]
        else:
            top: dict[str, float] = {}
            for (_i, t, lp) in tops:
                top.setdefault(t, lp)
            entry = (text, ev.logprob, top)
        self._pending.append((offset, entry))
        return self._release(len(emitted))

    def finish(self, tail: str) -> dict | None:
        """The end of the answer (tail: the FinalEvent's held-back text): entries it covers are released, the rest
        (a stop string's tokens) dropped."""
        out = self._release(len(tail))
        self._pending.clear()
        return out

    def _release(self, n_chars: int) -> dict | None:
        self._released += n_chars
        done = []
        while self._pending and self._pending[0][0] < self._released:
            done.append(self._pending.pop(0))
        if not done:
            return None
        if self.kind == "chat":
            entries = [e for _, e in done]
            self.content.extend(entries)
            return {"content": entries}
        chunk = {"tokens": [e[0] for _, e in done], "token_logprobs": [e[1] for _, e in done],
                 "top_logprobs": [e[2] for _, e in done], "text_offset": [o for o, _ in done]}
        self.tokens += chunk["tokens"]
        self.token_logprobs += chunk["token_logprobs"]
        self.top += chunk["top_logprobs"]
        self.offsets += chunk["text_offset"]
        return chunk

    def result(self) -> dict:
        if self.kind == "chat":
            return {"content": self.content}
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs, "top_logprobs": self.top,
                "text_offset": self.offsets}
