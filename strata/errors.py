"""How a request fails when it is not a bug: Refused (for what it asks: 4xx), Unavailable (now, whatever it asks:
503) and EngineFault (the engine or a worker produced something unusable: 5xx, the server's fault); every layer
raises them, serve maps them to HTTP by type; `printable` and `quoted`, how a peer's or server's text is quoted in a
message."""
from __future__ import annotations

import unicodedata


class Refused(ValueError):
    """A request refused for what it asks: the HTTP status it answers (400 unless a subclass says otherwise), the
    request field at fault (`param`, or None) and a machine-readable `code`."""

    status = 400
    param: str | None = None
    code = "invalid_value"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        if param is not None:
            self.param = param
        if code is not None:
            self.code = code


class Unavailable(RuntimeError):
    """The server cannot run a request now, whatever it asks: the HTTP status it answers (503) and a code (a remote
    stage's link down, its worker's error, the daemon draining)."""

    status = 503
    code = "unavailable"


class EngineFault(RuntimeError):
    """The engine, or a worker it relies on, produced something unusable (non-finite logits, a malformed result):
    the HTTP status it answers (500 unless a subclass says otherwise) and a code; never the client's fault."""

    status = 500
    code = "engine_error"


_BIDI = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def printable(text: str, keep: str = "") -> str:
    """text with its control characters (C0, DEL, C1: escape sequences), bidirectional controls and lone surrogates
    written as \\uXXXX, except those in `keep`: server text is safe to print, and JSON text stays valid JSON."""
    return "".join(f"\\u{ord(c):04x}" if c not in keep and (unicodedata.category(c) in ("Cc", "Cs") or c in _BIDI)
                   else c for c in text)


def quoted(text: str, limit: int = 500) -> str:
    """A peer's text (a worker's Error, a main's Hello field) as a one-line message quotes it: its first `limit`
    characters, control and bidirectional characters escaped (printable), and its length when it was longer."""
    return printable(text[:limit]) + (f"... ({len(text)} characters)" if len(text) > limit else "")
