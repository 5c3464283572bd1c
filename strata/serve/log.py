"""Logging setup for the daemon: structlog, JSON lines to stderr when it is not a TTY (journald), colours on a TTY."""
from __future__ import annotations

import logging
import sys

import structlog

LEVELS = ("debug", "info", "warning", "error", "critical")


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
    structlog.configure(
        processors=shared + [structlog.processors.StackInfoRenderer(),
                             structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
