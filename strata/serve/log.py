"""Logging setup for the daemon: structlog, JSON lines to stderr when it is not a TTY (journald), colours on a TTY."""
from __future__ import annotations

import logging
import re
import sys

import structlog

LEVELS = ("debug", "info", "warning", "error", "critical")


def malformed(exc: BaseException) -> str | None:
    """What a client's malformed HTTP comes to in one line: "<error type>: <aiohttp's text>" without aiohttp's status
    prefix and the raw bytes it quotes (a prompt must not end up in the journal) and cut to 200 characters; None for an exception that is
    not about the request's bytes. Covers a request line or header aiohttp cannot parse and broken chunked framing
    (a body's Content-Encoding is decoded by strata.serve.body_coding, not by aiohttp)."""
    from aiohttp.http_exceptions import HttpProcessingError
    from aiohttp.web_protocol import RequestPayloadError
    if isinstance(exc, RequestPayloadError) and isinstance(exc.__cause__, HttpProcessingError):
        exc = exc.__cause__
    if not isinstance(exc, HttpProcessingError):
        return None
    text = re.split(r"\s+b['\"]", " ".join(str(exc).split()), maxsplit=1)[0]   # not the quoted bytes
    # aiohttp's "400, message: <what>:" -> "<what>": its status prefix and the colon that introduced the bytes go too
    text = re.sub(r"^\d{3}, message: ", "", text).rstrip(" :") or "malformed request"
    return f"{type(exc).__name__}: {text[:200]}"


class _MalformedRequestFilter(logging.Filter):
    """aiohttp logs a malformed HTTP message (bad chunked framing, a header it cannot parse) at ERROR with a
    traceback whose exception text quotes the raw bytes, so one bad request can put a whole prompt into the journal;
    keep one WARNING line naming the error (malformed())."""

    def filter(self, record: logging.LogRecord) -> bool:
        why = malformed(record.exc_info[1]) if record.exc_info else None
        if why is not None:
            record.msg, record.args = f"malformed HTTP request: {why}", ()
            record.exc_info, record.exc_text = None, None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def configure_logging(level: str = "info", *, json: bool | None = None, stream=None) -> None:
    """Route structlog and stdlib logging (aiohttp's too) through one renderer on `stream` (stderr).

    json=None picks JSON lines unless the stream is a TTY. Context bound with
    structlog.contextvars (the request id) appears on every line of that context.
    """
    if level.lower() not in LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LEVELS)}, got {level!r}")
    stream = stream or sys.stderr
    if json is None:
        json = not (hasattr(stream, "isatty") and stream.isatty())
    shared = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer = (structlog.processors.JSONRenderer() if json
                else structlog.dev.ConsoleRenderer(colors=True))
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    structlog.processors.format_exc_info if json else (lambda _l, _m, e: e),
                    renderer],
    )
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level.upper())
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    server = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, _MalformedRequestFilter) for f in server.filters):
        server.addFilter(_MalformedRequestFilter())
    structlog.configure(
        processors=shared + [structlog.processors.StackInfoRenderer(),
                             structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
