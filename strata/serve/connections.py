"""The daemon's connections: at most --max-connections open per listener (one more is answered 503 and closed), none
kept open by a client that sends nothing, dribbles a request's header, or stays idle between requests past its
timeout, and HTTP that aiohttp cannot parse answered with a JSON error (OpenAI's shape: no route was read) rather
than aiohttp's plain text. Request bodies have their own deadline (handling.read_body)."""
from __future__ import annotations

import asyncio
import json
import resource
import time
from dataclasses import dataclass, field

import structlog
from aiohttp import web
from aiohttp.web_protocol import RequestHandler, RequestPayloadError

from strata.serve.log import malformed

log = structlog.get_logger("strata.serve")

#: file descriptors kept for everything but connections (the model file, logs, the engine's pipes and threads)
FD_RESERVE = 64


def connection_cap(wanted: int, listeners: int) -> int:
    """--max-connections per listener, lowered so that every listener's connections fit the process's descriptor
    limit (raised to its hard limit first, as servers do)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY:
        return wanted
    return max(1, min(wanted, (soft - FD_RESERVE) // max(1, listeners)))


def _refusal(message: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "server_error", "param": None,
                                 "code": "too_many_connections"}}).encode()
    return (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
            b"Retry-After: 1\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


@dataclass
class _State:
    listener: str
    opened: float
    idle_since: float                 # when the connection last had no request in hand
    first_rx: float | None = None     # the first byte of a request not yet in hand
    active: int = 0                   # requests being handled


@dataclass
class ConnectionGuard:
    """Connections per listener ("unix" or "tcp"), their limits and the watchdog that closes the ones past their
    timeout. wrap(server) is the protocol factory the sites listen with; begin / end mark a request in hand."""

    max_connections: int = 256
    header_timeout: float = 15.0
    idle_timeout: float = 60.0
    conns: dict = field(default_factory=dict)        # transport -> _State
    refused: int = 0
    closed_slow: int = 0

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in self.conns.values():
            out[s.listener] = out.get(s.listener, 0) + 1
        return out

    def wrap(self, server):
        return _GuardedServer(server, self)

    def middleware(self):
        """The application middleware that marks each request in hand on its connection."""
        @web.middleware
        async def track(request: web.Request, handler):
            t = request.transport
            self.begin(t)
            try:
                return await handler(request)
            finally:
                self.end(t)
        return track

    def status(self) -> dict:
        """For /status: open connections per listener, the limit, connections refused and closed as too slow."""
        return {"open": self.counts(), "max_per_listener": self.max_connections, "refused": self.refused,
                "closed_slow": self.closed_slow, "header_timeout_s": self.header_timeout,
                "idle_timeout_s": self.idle_timeout}

    # ---- what the protocol and the middleware report
    def opened(self, transport) -> bool:
        """Register a new connection; False (and a 503 written, the transport closed) when its listener is full."""
        listener = "unix" if isinstance(transport.get_extra_info("sockname"), (str, bytes)) else "tcp"
        now = time.monotonic()
        if self.counts().get(listener, 0) >= self.max_connections:
            self.refused += 1
            if self.refused == 1 or self.refused % 100 == 0:
                log.warning("connection refused: too many open", listener=listener, limit=self.max_connections,
                            refused=self.refused)
            transport.write(_refusal(f"the server has {self.max_connections} connections open on this listener "
                                     f"(--max-connections); retry later"))
            transport.close()
            return False
        self.conns[transport] = _State(listener, now, now)
        return True

    def received(self, transport) -> None:
        s = self.conns.get(transport)
        if s is not None and s.active == 0 and s.first_rx is None:
            s.first_rx = time.monotonic()

    def closed(self, transport) -> None:
        self.conns.pop(transport, None)

    def begin(self, transport) -> None:
        s = self.conns.get(transport)
        if s is not None:
            s.active += 1
            s.first_rx = None

    def end(self, transport) -> None:
        s = self.conns.get(transport)
        if s is not None:
            s.active = max(0, s.active - 1)
            if s.active == 0:
                s.idle_since = time.monotonic()

    # ---- the watchdog
    def sweep(self, now: float | None = None) -> int:
        """Close every connection past its timeout: a request's header not in hand `header_timeout` after its first
        byte, nothing asked `idle_timeout` after the last answer (or the connection). Returns how many."""
        now = time.monotonic() if now is None else now
        late = [t for t, s in self.conns.items() if s.active == 0 and (
            (s.first_rx is not None and now - s.first_rx > self.header_timeout)
            or (s.first_rx is None and now - s.idle_since > self.idle_timeout))]
        for t in late:
            self.conns.pop(t, None)
            t.close()
        self.closed_slow += len(late)
        return len(late)

    async def watch(self, every: float = 0.5) -> None:
        while True:
            await asyncio.sleep(every)
            self.sweep()


class _GuardedServer:
    """aiohttp's Server, whose protocols report to the guard (every other attribute is the server's)."""

    def __init__(self, server, guard: ConnectionGuard):
        self._server, self._guard = server, guard

    def __call__(self):
        return _GuardedProtocol(_request_handler(self._server), self._guard)

    def __getattr__(self, name):
        return getattr(self._server, name)


class _JsonErrorsHandler(RequestHandler):
    """aiohttp's RequestHandler whose answer to a request its parser refuses (a request line or header it cannot read,
    broken chunked framing) is a JSON error in OpenAI's shape (no route was read), code bad_http. aiohttp still logs
    it (strata.serve.log keeps one warning line without the raw bytes) and closes the connection. A parse error in
    the body of the request being handled fails that request's body read instead (see data_received)."""

    def data_received(self, data: bytes) -> None:
        """aiohttp's, and: when its parser fails inside the body of a request already parsed (chunked framing broken
        in a later packet), aiohttp queues an error message behind that request but leaves its body unfinished, so
        the handler's read would wait for --body-timeout. That body's read fails now (RequestPayloadError: the
        handler's 400), whether its handler runs or the request still waits its turn behind a pipelined one; the
        queued error message goes. A running handler's connection closes after its answer; a waiting request is
        answered in its turn, and the client's next bytes meet the failed parser (aiohttp's 400, then it closes)."""
        queued = len(self._messages)
        super().data_received(data)
        if len(self._messages) <= queued:
            return
        err = self._messages[-1][0]
        if not isinstance(getattr(err, "exc", None), BaseException) or getattr(err, "status", None) != 400:
            return
        bodies = [p for _, p in list(self._messages)[:-1]]     # the requests parsed before it, still to be handled
        if self._current_request is not None:
            bodies.insert(0, self._current_request.content)
        open_bodies = [p for p in bodies if not p.is_eof()]
        if not open_bodies:                  # the error is in a request of its own: aiohttp answers it
            return
        self._messages.pop()
        failed = RequestPayloadError(getattr(err, "message", "") or str(err.exc))
        failed.__cause__ = err.exc
        open_bodies[-1].set_exception(failed)      # the parser was inside the last one begun
        if self._current_request is not None and open_bodies[-1] is self._current_request.content:
            self.close()                     # (closing now would drop a waiting request unanswered)

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None, message: str | None = None):
        resp = super().handle_error(request, status, exc, message)      # aiohttp's log line and its checks
        if status >= 500:                     # not a client's fault: aiohttp's own answer
            return resp
        why = (malformed(exc) if exc is not None else None) or " ".join(str(message or "bad request").split())[:200]
        body = json.dumps({"error": {"message": f"malformed HTTP request: {why}", "type": "invalid_request_error",
                                     "param": None, "code": "bad_http"}}, ensure_ascii=False)
        resp = web.Response(status=status, text=body, content_type="application/json")
        resp.force_close()
        return resp


def _request_handler(server) -> RequestHandler:
    """A _JsonErrorsHandler made as aiohttp's Server makes its RequestHandler (server() where it cannot be)."""
    try:
        return _JsonErrorsHandler(server, loop=server._loop, **server._kwargs)
    except (AttributeError, TypeError):
        return server()


class _GuardedProtocol(asyncio.Protocol):
    """aiohttp's RequestHandler behind the guard: a connection over the listener's limit never reaches it."""

    def __init__(self, handler, guard: ConnectionGuard):
        self._h, self._guard, self._t, self._live = handler, guard, None, False

    def connection_made(self, transport) -> None:
        self._t = transport
        if self._guard.opened(transport):
            self._live = True
            self._h.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._live:
            self._guard.received(self._t)
            self._h.data_received(data)

    def eof_received(self):
        return self._h.eof_received() if self._live else None

    def connection_lost(self, exc) -> None:
        self._guard.closed(self._t)
        if self._live:
            self._h.connection_lost(exc)

    def pause_writing(self) -> None:
        if self._live:
            self._h.pause_writing()

    def resume_writing(self) -> None:
        if self._live:
            self._h.resume_writing()
