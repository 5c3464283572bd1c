"""NgramIndex: where a token sequence's own earlier text continues its last tokens (prompt-lookup drafts), kept in
n-gram hash chains updated per token appended or cut back.

For each n in [n_min, n_max] the index holds every n-gram tokens[e - n:e] whose next token tokens[e] is known, by its
end e, in hash chains (the structure of LZ77 / zlib's match finder): ``head[n]`` maps an n-gram's 64-bit polynomial
hash to its most recent end, ``prev[n][e]`` is the end of the same hash's occurrence before e (-1: none). Appending
k tokens links k ends per n (O(k)); cutting back to L unlinks the ends past L newest first (O(removed)), so a
sequence that grows, is cut back and grows again never rescans what it kept. A long append (a prompt) is linked
with numpy (a stable sort of its hashes), a short one in a Python loop; both give the same chains.

``propose(k)`` looks at the sequence's last n tokens for n = n_max down to n_min and takes the first n with an
earlier occurrence: among the ``hops`` most recent occurrences (hash collisions are checked against the tokens and
skipped), the one whose preceding text agrees with the sequence's for the most tokens (up to ``reach``; the most
recent among equals), and proposes the k tokens that followed it. Where the continuation runs into the sequence's
end it goes on copying from the proposal itself (a repeated pattern continues), as an LZ77 match may overlap.
Nothing here scans the sequence: a proposal costs O(n_max + hops * reach + k).
"""
from __future__ import annotations

import numpy as np

#: the polynomial hash's multiplier (odd, 64-bit); hashes wrap modulo 2 ** 64
_P = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1
#: appends of at least this many tokens are linked with numpy, shorter ones in a Python loop
_BULK = 48


class NgramIndex:
    """The n-gram hash chains of one token sequence (see the module's docstring). n_min..n_max: the n-gram lengths
    looked up (longest first); hops: occurrences of the matched n-gram compared at most; reach: tokens of preceding
    text compared at most per occurrence."""

    def __init__(self, n_min: int = 2, n_max: int = 4, hops: int = 8, reach: int = 64):
        if not 1 <= n_min <= n_max:
            raise ValueError(f"n-gram lengths must satisfy 1 <= n_min <= n_max, got {n_min}..{n_max}")
        self.n_min, self.n_max, self.hops, self.reach = int(n_min), int(n_max), max(1, int(hops)), max(0, int(reach))
        self._toks = np.zeros(256, np.int64)
        self._n = 0
        self.head: dict[int, dict[int, int]] = {n: {} for n in range(self.n_min, self.n_max + 1)}
        self.prev: dict[int, np.ndarray] = {n: np.full(256, -1, np.int64) for n in self.head}

    def __len__(self) -> int:
        return self._n

    @property
    def tokens(self) -> np.ndarray:
        """The sequence indexed (a read-only view, valid until it changes)."""
        v = self._toks[:self._n]
        v.flags.writeable = False
        return v

    # ---- hashes
    def _keys(self, n: int, lo: int, hi: int) -> np.ndarray:
        """The hashes of the n-grams ending at lo..hi-1 (each lo >= n), uint64."""
        t = self._toks.view(np.uint64)
        h = np.zeros(hi - lo, np.uint64)
        with np.errstate(over="ignore"):
            for j in range(n):
                h = h * np.uint64(_P) + t[lo - n + j:hi - n + j]
        return h

    def _key(self, n: int, e: int) -> int:
        """The hash of the n-gram ending at e (before e), as _keys gives it."""
        h = 0
        for t in self._toks[e - n:e].tolist():
            h = (h * _P + (t & _MASK)) & _MASK
        return h

    # ---- growing and cutting back
    def _grow(self, n: int) -> None:
        if n > self._toks.shape[0]:
            cap = max(n, 2 * self._toks.shape[0])
            toks = np.zeros(cap, np.int64)
            toks[:self._n] = self._toks[:self._n]
            self._toks = toks
            for k, p in self.prev.items():
                q = np.full(cap, -1, np.int64)
                q[:p.shape[0]] = p
                self.prev[k] = q

    def extend(self, tokens) -> None:
        """Append `tokens`: the n-grams ending before each of them (whose next token is now known) are linked."""
        toks = np.asarray(tokens, dtype=np.int64).reshape(-1)
        k = int(toks.shape[0])
        if not k:
            return
        lo, hi = self._n, self._n + k
        self._grow(hi)
        self._toks[lo:hi] = toks
        self._n = hi
        for n, head in self.head.items():
            prev = self.prev[n]
            a = max(lo, n)                       # ends a..hi-1: the n-gram before e, e's token its continuation
            if a >= hi:
                continue
            if hi - a < _BULK:
                for e in range(a, hi):
                    key = self._key(n, e)
                    prev[e] = head.get(key, -1)
                    head[key] = e
                continue
            keys = self._keys(n, a, hi)
            ends = np.arange(a, hi, dtype=np.int64)
            order = np.argsort(keys, kind="stable")          # same hash together, older first
            ks, es = keys[order], ends[order]
            first = np.ones(ks.shape[0], bool)
            first[1:] = ks[1:] != ks[:-1]
            last = np.ones(ks.shape[0], bool)
            last[:-1] = first[1:]
            p = np.empty(ks.shape[0], np.int64)
            p[1:] = es[:-1]
            fk = ks[first].tolist()
            p[first] = [head.get(x, -1) for x in fk] if head else -1
            prev[es] = p
            head.update(zip(ks[last].tolist(), es[last].tolist()))

    def truncate(self, length: int) -> None:
        """Cut the sequence back to its first `length` tokens (the ends past it unlinked, newest first)."""
        length = max(0, int(length))
        if length >= self._n:
            return
        for n, head in self.head.items():
            prev = self.prev[n]
            a = max(length, n)
            if a >= self._n:
                continue
            keys = self._keys(n, a, self._n).tolist() if self._n - a >= _BULK else \
                [self._key(n, e) for e in range(a, self._n)]
            for e in range(self._n - 1, a - 1, -1):
                key, p = keys[e - a], int(prev[e])
                if p < 0:
                    head.pop(key, None)
                else:
                    head[key] = p
                prev[e] = -1
        self._n = length

    def common_prefix(self, tokens) -> int:
        """How many leading tokens this sequence shares with `tokens` (one numpy comparison)."""
        toks = np.asarray(tokens).reshape(-1)
        m = min(self._n, int(toks.shape[0]))
        diff = np.flatnonzero(self._toks[:m] != toks[:m])
        return int(diff[0]) if diff.size else m

    # ---- proposing
    def _agree(self, e: int, n: int) -> int:
        """Tokens before the n-gram ending at e that agree with those before the sequence's last n (up to reach)."""
        end = self._n - n
        r = min(self.reach, e - n)
        if r <= 0:
            return 0
        a = self._toks[e - n - r:e - n][::-1]
        b = self._toks[end - r:end][::-1]
        diff = np.flatnonzero(a != b)
        return int(diff[0]) if diff.size else r

    def match(self) -> tuple[int, int] | None:
        """(n, e): the n-gram length matched and the end of the occurrence chosen (tokens[e] the first proposed),
        or None where no n in n_min..n_max has an earlier occurrence of the sequence's last n tokens."""
        N = self._n
        toks = self._toks
        for n in range(min(self.n_max, N - 1), self.n_min - 1, -1):
            e = self.head[n].get(self._key(n, N))
            best, best_agree, seen = None, -1, 0
            tail = toks[N - n:N].tolist()
            while e is not None and e >= 0 and seen < self.hops:
                if toks[e - n:e].tolist() == tail:     # a hash collision is skipped
                    seen += 1
                    agree = self._agree(e, n)
                    if agree > best_agree:
                        best, best_agree = e, agree
                    if agree >= self.reach:
                        break
                e = int(self.prev[n][e])
            if best is not None:
                return n, best
        return None

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the chosen earlier occurrence of the sequence's last tokens ([] where none
        has one): copied from the sequence, then (past its end) from the proposal itself."""
        if k <= 0:
            return []
        m = self.match()
        if m is None:
            return []
        e = m[1]
        out = self._toks[e:min(e + k, self._n)].tolist()
        while len(out) < k:                      # overlapping the end: the pattern repeats
            out.append(out[e + len(out) - self._n])
        return out
