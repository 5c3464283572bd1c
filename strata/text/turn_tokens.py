"""TurnTokens: the tokenized pieces of the last few chat renders, so that a later turn splits and tokenizes only the
pieces after what it shares with one of them (the ids of the shared prefix reused, exactly those a full
tokenization gives)."""
from __future__ import annotations

import bisect
import itertools
import threading
import operator
from operator import itemgetter
from dataclasses import dataclass

import numpy as np

from strata.text.tokenizer import Fragment, Tokenizer

__all__ = ["Tokenized", "TurnTokens"]

_NEAR = 8       # a kept render sharing all but this many of the new pieces is taken without looking further


@dataclass
class Tokenized:
    """A prompt's pieces [(text, parse_special)] tokenized: the joined text, its fragments (Tokenizer.split_special),
    each fragment's ids, the token offset where each fragment starts (`starts`), every id as a read-only int32 array
    (`ids`, with the BOS the tokenizer adds, `bos` of them), and the character offset where each piece starts."""
    pieces: list[tuple[str, bool]]
    text: str
    frags: list[Fragment]
    parts: list[list[int]]
    starts: list[int]
    ids: np.ndarray
    bos: int
    piece_at: list[int]
    char_starts: list[int]   # the character offset where each fragment starts
    reused: int = 0          # leading token ids taken from an earlier render (0: tokenized in full)


def _piece_offsets(pieces, start: int = 0) -> list[int]:
    """The character offset where each piece starts, the first at `start`."""
    return list(itertools.accumulate(map(len, map(itemgetter(0), pieces[:-1])), initial=start)) if pieces else []


def _shared(a: list, b: list) -> int:
    """How many leading items a and b share (one pass in C; items that are the same object compare at once)."""
    return next(itertools.compress(itertools.count(), map(operator.ne, a, b)), min(len(a), len(b)))


class TurnTokens:
    """The last `keep` Tokenized results of one tokenizer. ``tokenize(pieces)`` finds the kept one sharing the most
    leading pieces with `pieces` and reuses its fragments and ids up to the end of the last special token inside the
    shared pieces; the text after that point is split and tokenized as a full tokenization would (a special token's
    end is where llama.cpp's partition restarts: no special token match and no BPE merge crosses it, and the raw text
    after it starts as after any special token), so the ids equal ``Tokenizer.encode_pieces`` of the same pieces
    (tests/test_turn_tokens.py checks this with hypothesis against the full path). Thread-safe."""

    def __init__(self, tokenizer: Tokenizer, keep: int = 4):
        self.tokenizer = tokenizer
        self.keep = int(keep)
        self._kept: list[Tokenized] = []
        self._lock = threading.Lock()
        self.stats = {"calls": 0, "reused_tokens": 0, "new_tokens": 0}

    def _best(self, pieces) -> tuple[Tokenized | None, int]:
        """(the kept result sharing the most leading pieces, how many), or (None, 0)."""
        with self._lock:
            kept = list(self._kept)
        best, best_j = None, 0
        for e in kept:                  # the latest first: a later turn shares all but its last pieces with it
            j = _shared(pieces, e.pieces)
            if j > best_j:
                best, best_j = e, j
            if best_j >= len(pieces) - _NEAR:
                break
        return best, best_j

    def tokenize(self, pieces: list[tuple[str, bool]]) -> Tokenized:
        """`pieces` split into fragments (special tokens parsed only in pieces whose flag is True, as
        Tokenizer.split_special) and tokenized, with the BOS the tokenizer adds unless the text starts with it.
        Raises ValueError for text that is not valid Unicode."""
        tk = self.tokenizer
        pieces = list(pieces) if all(map(itemgetter(0), pieces)) else [p for p in pieces if p[0]]
        e, j = self._best(pieces)
        k = 0                    # fragments of e reused
        if e is not None:
            end = e.piece_at[j - 1] + len(e.pieces[j - 1][0])  # the shared pieces cover e.text[:end]
            k = len(e.frags)
            while k > 0 and not (e.frags[k - 1].token_id is not None and e.frags[k - 1].end <= end):
                k -= 1
        if k == 0:
            text, frags = tk.split_special(pieces)
            char_starts = [f.start for f in frags]
            piece_at = _piece_offsets(pieces)
            parts = tk.encode_fragments(text, frags)
            bos = int(tk.add_bos and tk.bos_id is not None and not (frags and frags[0].token_id == tk.bos_id))
            starts, n = [], bos
            for p in parts:
                starts.append(n)
                n += len(p)
            ids = np.empty(n, np.int32)
            if bos:
                ids[0] = tk.bos_id
            if n > bos:
                ids[bos:] = np.fromiter(itertools.chain.from_iterable(parts), np.int32, n - bos)
            reused = 0
        else:
            b = e.frags[k - 1].end                               # the split point: a special token's end
            m = bisect.bisect_left(e.piece_at, b, 1) - 1       # the first piece ending at or after it
            rest = [(pieces[m][0][b - e.piece_at[m]:], pieces[m][1])] + pieces[m + 1:]
            tail_text, tail = tk.split_special(rest)
            tail = [Fragment(f.start + b, f.end + b, f.token_id) for f in tail]
            text = e.text[:b] + tail_text
            tail_parts = tk.encode_fragments(text, tail)
            bos = e.bos
            p0 = e.starts[k - 1] + len(e.parts[k - 1])          # tokens before the split point
            frags = e.frags[:k] + tail
            char_starts = e.char_starts[:k] + [f.start for f in tail]
            piece_at = e.piece_at[:j] + _piece_offsets(pieces[j:], e.piece_at[j - 1] + len(pieces[j - 1][0])) \
                if j < len(pieces) else e.piece_at[:j]
            parts = e.parts[:k] + tail_parts
            starts, n = e.starts[:k], p0
            for p in tail_parts:
                starts.append(n)
                n += len(p)
            ids = np.empty(n, np.int32)
            ids[:p0] = e.ids[:p0]
            if n > p0:
                ids[p0:] = np.fromiter(itertools.chain.from_iterable(tail_parts), np.int32, n - p0)
            reused = p0
        ids.flags.writeable = False
        out = Tokenized(pieces=pieces, text=text, frags=frags, parts=parts, starts=starts, ids=ids, bos=bos,
                        piece_at=piece_at, char_starts=char_starts, reused=reused)
        with self._lock:
            self.stats["calls"] += 1
            self.stats["reused_tokens"] += reused
            self.stats["new_tokens"] += len(ids) - reused
            if self.keep > 0:
                self._kept = [x for x in self._kept if x is not e][: self.keep - 1]
                self._kept.insert(0, out)
        return out
