"""How a request fails when it is not a bug: Refused (for what it asks: 4xx), Unavailable (now, whatever it asks:
503) and EngineFault (the engine or a worker produced something unusable: 5xx, the server's fault); every layer
raises them, serve maps them to HTTP by type."""
from __future__ import annotations


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
