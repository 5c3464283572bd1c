"""PrefixEnds: where each message of a chat ends in its rendered text, kept across requests by a hash chain over the messages."""
from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict

__all__ = ["PrefixEnds", "is_plain", "prefix_digests"]

_SCALARS = (str, int, float, bool, type(None))


def is_plain(x) -> bool:
    """Whether `x` is built only of dicts with str keys, lists, str, int, float, bool and None: values whose repr
    names them one-to-one (so equal reprs render equally)."""
    t = type(x)
    if t in _SCALARS:
        return True
    if t is list:
        return all(is_plain(v) for v in x)
    if t is dict:
        return all(type(k) is str and is_plain(v) for k, v in x.items())
    return False


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def prefix_digests(text: str, ends) -> dict[int, bytes]:
    """{c: digest of text[:c]} for every c in `ends` (0 <= c <= len(text)), in one pass over the text."""
    h = hashlib.blake2b(digest_size=16)
    out: dict[int, bytes] = {}
    prev = 0
    for c in sorted(set(ends)):
        h.update(text[prev:c].encode("utf-8", "surrogatepass"))
        prev = c
        out[c] = h.copy().digest()
    return out


class PrefixEnds:
    """The chat template's message cut points come from rendering each prefix of the chat (strata.text.chat_template):
    render(messages[:i+1]) ends where message i ends. A client resends the whole conversation every turn, so all
    but the newest prefixes were rendered by an earlier request: this keeps, per prefix, the length of its rendering
    and a digest of that text, keyed by a hash chain over (the render's other inputs, message 0, ..., message i).

    A kept end is used only when the new request's text starts with the same text (its digest over text[:end]
    matches), so a template whose output changed for the same messages (one that prints the date) renders again.
    Messages and inputs that are not plain JSON-like values (dicts with str keys, lists, str, numbers, bool, None)
    are not keyed: such a request renders every prefix as before. Bounded (the least recently used leave first);
    thread-safe (the daemon renders in an executor's threads).
    """

    def __init__(self, max_entries: int = 8192):
        self.max_entries = int(max_entries)
        self._items: OrderedDict[bytes, tuple[int, bytes]] = OrderedDict()
        self._lock = threading.Lock()
        self.stats = {"hits": 0, "misses": 0, "stale": 0}
        self._last: tuple[bytes, list, list[bytes]] | None = None    # the last chain: context key, messages, keys

    def chain(self, context, messages) -> list[bytes] | None:
        """Keys of the prefixes messages[:1], messages[:2], ... rendered with `context` (the other inputs), or
        None when something is not a plain value. The keys of the leading messages equal (==) to the last chain's
        are taken from it, so a later turn hashes only its new messages (equal messages that render differently,
        {"a": 1} and {"a": True}, are caught where every kept end is: the new text must start with its text)."""
        if self.max_entries <= 0 or not is_plain(context):
            return None
        h = h0 = _digest(repr(context).encode("utf-8", "surrogatepass"))
        keys: list[bytes] = []
        last = self._last
        if last is not None and last[0] == h0:
            old, old_keys = last[1], last[2]
            k, n = 0, min(len(old), len(messages))
            while k < n and type(messages[k]) is dict and messages[k] == old[k]:
                k += 1
            keys = old_keys[:k]
        if not all(is_plain(m) for m in messages[len(keys):]):
            return None
        if keys:
            h = keys[-1]
        for m in messages[len(keys):]:
            h = _digest(h + repr(m).encode("utf-8", "surrogatepass"))
            keys.append(h)
        self._last = (h0, list(messages), keys)
        return keys

    def get(self, key: bytes) -> tuple[int, bytes] | None:
        """(end, digest of the text up to it) kept for `key`, or None."""
        with self._lock:
            hit = self._items.get(key)
            if hit is None:
                self.stats["misses"] += 1
                return None
            self._items.move_to_end(key)
            self.stats["hits"] += 1
            return hit

    def put(self, key: bytes, end: int, digest: bytes) -> None:
        with self._lock:
            self._items[key] = (int(end), digest)
            self._items.move_to_end(key)
            while len(self._items) > self.max_entries:
                self._items.popitem(last=False)

    def stale(self) -> None:
        """Count a kept end that the new text no longer starts with."""
        with self._lock:
            self.stats["stale"] += 1

    def __len__(self) -> int:
        return len(self._items)
