"""FragmentCache: token ids of text fragments between special tokens, kept across requests (bounded, least recently used out)."""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Hashable

__all__ = ["FragmentCache"]


class FragmentCache:
    """Token ids of raw text fragments (the text between two special tokens), so that a chat client's next turn
    tokenizes only what is new: every earlier message is one or more fragments whose ids are looked up.

    Reuse is exact: llama.cpp's tokenizer (and strata.text.tokenizer, which matches it) tokenizes each fragment between
    special tokens on its own, so a fragment's ids depend only on its text (and, for SentencePiece models, whether
    a special token or the input's start comes before it: part of the key). BPE merges never cross a special token.

    max_tokens bounds the ids kept (the least recently used fragments leave first; about 40 bytes a token as
    Python tuples, so the default 2**20 tokens is ~40 MiB at most); fragments shorter than min_chars are not kept
    (they cost less to tokenize than to look up). Thread-safe: the daemon tokenizes in an executor's threads.
    """

    def __init__(self, max_tokens: int = 1 << 20, min_chars: int = 64):
        if max_tokens < 0 or min_chars < 0:
            raise ValueError(f"max_tokens and min_chars must be >= 0, got {max_tokens}, {min_chars}")
        self.max_tokens = int(max_tokens)
        self.min_chars = int(min_chars)
        self._items: OrderedDict[Hashable, tuple[int, ...]] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()
        self.stats = {"hits": 0, "misses": 0, "hit_tokens": 0, "evicted": 0}

    def wants(self, text: str) -> bool:
        """Whether a fragment of this text is worth looking up and keeping."""
        return self.max_tokens > 0 and len(text) >= self.min_chars

    def get(self, key: Hashable) -> list[int] | None:
        """The ids kept for `key` (a new list), or None."""
        with self._lock:
            ids = self._items.get(key)
            if ids is None:
                self.stats["misses"] += 1
                return None
            self._items.move_to_end(key)
            self.stats["hits"] += 1
            self.stats["hit_tokens"] += len(ids)
        return list(ids)

    def put(self, key: Hashable, ids) -> None:
        """Keep `ids` for `key`; the least recently used fragments leave to stay within max_tokens (ids longer than
        that are not kept)."""
        ids = tuple(ids)
        if len(ids) > self.max_tokens:
            return
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._tokens -= len(old)
            self._items[key] = ids
            self._tokens += len(ids)
            while self._tokens > self.max_tokens:
                _, gone = self._items.popitem(last=False)
                self._tokens -= len(gone)
                self.stats["evicted"] += 1

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._tokens = 0

    def __len__(self) -> int:
        return len(self._items)

    @property
    def tokens(self) -> int:
        """Token ids kept."""
        return self._tokens
