"""Running the daemon: bind the Unix socket (and TCP), load the engine on its thread, sd_notify, drain on SIGTERM."""
from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import sys
import signal
import socket
from pathlib import Path
from typing import Any, Callable

import structlog
from aiohttp import web

from strata.engine import gc_pauses
from strata.serve.app import make_app
from strata.serve.config import ServeConfig, format_hostport
from strata.serve.connections import ConnectionGuard, connection_cap
from strata.errors import Unavailable
from strata.serve.errors import ApiError
from strata.serve.metrics import Metrics
from strata.serve.notify import sd_notify, watchdog, watchdog_interval
from strata.serve.worker import EngineError, EngineWorker, ShuttingDown

log = structlog.get_logger("strata.serve")


SUN_PATH_MAX = 107   # bytes of a Unix socket path on Linux (struct sockaddr_un.sun_path is 108 with the NUL)


class StartupError(RuntimeError):
    """The daemon could not start (socket in use, model failed to load); the message is one line."""


def _prepare_socket(path: Path) -> None:
    """Create the socket's directory (0750 if new) and remove a stale socket; refuse one that is live, and a path
    longer than a Unix socket address holds (sun_path: 108 bytes with the terminating NUL on Linux)."""
    n = len(os.fsencode(str(path)))
    if n > SUN_PATH_MAX:
        raise StartupError(f"socket path {path} is {n} bytes, over the {SUN_PATH_MAX}-byte limit of Unix socket "
                           "addresses; choose a shorter --socket")
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o750)
    except OSError as e:
        raise StartupError(f"cannot create the socket directory {path.parent}: {e.strerror or e}") from None
    if path.exists() or path.is_symlink():
        if not path.is_socket():
            raise StartupError(f"{path} exists and is not a socket; refusing to replace it")
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.settimeout(1.0)
            s.connect(str(path))
        except OSError as e:
            if e.errno not in (errno.ECONNREFUSED, errno.ENOENT):
                raise StartupError(f"cannot check the existing socket {path}: {e}") from None
            path.unlink(missing_ok=True)  # stale: nobody listens
        else:
            raise StartupError(f"another daemon is already listening on {path}")
        finally:
            s.close()


class _GuardedRunner(web.AppRunner):
    """aiohttp's AppRunner whose sites accept connections through the ConnectionGuard."""

    def __init__(self, app: web.Application, guard: ConnectionGuard, **kwargs):
        super().__init__(app, **kwargs)
        self._guard = guard

    async def _make_server(self):
        return self._guard.wrap(await super()._make_server())


#: how long a thread that wants the GIL waits for the thread holding it (Python's default is 5 ms): the event loop
#: writes a token the engine thread just handed over while that thread already runs the next decode step's Python
GIL_SWITCH_S = 0.0005


async def serve(cfg: ServeConfig, engine_factory: Callable[[], Any]) -> int:
    """Serve until SIGTERM/SIGINT; returns the process exit status (0 after a clean drain)."""
    sys.setswitchinterval(GIL_SWITCH_S)
    gc_pauses.install()
    loop = asyncio.get_running_loop()
    metrics = Metrics()
    worker = EngineWorker(engine_factory, queue_max=cfg.queue_max, metrics=metrics, loop=loop)
    listeners = int(cfg.socket_path is not None) + int(cfg.port is not None)
    cap = connection_cap(cfg.max_connections, listeners)
    if cap < cfg.max_connections:
        log.warning("--max-connections lowered to what the descriptor limit holds (raise LimitNOFILE / ulimit -n)",
                    asked=cfg.max_connections, per_listener=cap)
    guard = ConnectionGuard(max_connections=cap, header_timeout=cfg.header_timeout, idle_timeout=cfg.idle_timeout)
    app = make_app(cfg, worker, metrics, guard)
    runner = _GuardedRunner(app, guard, handler_cancellation=True, access_log=None, shutdown_timeout=5.0,
                            keepalive_timeout=cfg.idle_timeout, auto_decompress=False)
    await runner.setup()
    sweeper = asyncio.ensure_future(guard.watch())
    sock_path = Path(cfg.socket_path) if cfg.socket_path else None
    sock_made = False
    try:
        if sock_path is not None:
            _prepare_socket(sock_path)
            try:
                await web.UnixSite(runner, str(sock_path)).start()
            except OSError as e:
                raise StartupError(f"cannot listen on {sock_path}: {e.strerror or e}") from None
            sock_made = True
            os.chmod(sock_path, 0o660)
        if cfg.port is not None:
            try:
                await web.TCPSite(runner, cfg.host, cfg.port).start()
            except OSError as e:
                raise StartupError(f"cannot listen on {cfg.tcp_address()}: {e.strerror or e}") from None
            bound = [a for a in runner.addresses if isinstance(a, tuple)]     # (host, port[, flow, scope])
            if bound:
                cfg.tcp_bound = ", ".join(format_hostport(str(a[0]), int(a[1])) for a in bound)
    except BaseException:
        sweeper.cancel()
        await runner.cleanup()
        if sock_made:                       # leave no socket file behind that nobody listens on
            with contextlib.suppress(OSError):
                sock_path.unlink()
        raise
    log.info("listening", socket=str(sock_path) if sock_path else None,
             tcp=cfg.tcp_address(), pid=os.getpid(), max_connections=guard.max_connections)

    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    worker.start()
    sd_notify("STATUS=loading the model")
    every = watchdog_interval()            # systemd's WatchdogSec=: pings stop while the engine thread is stuck
    pinger = asyncio.ensure_future(watchdog(every, lambda: worker.stuck(cfg.stall_seconds))) if every else None
    stop_task = asyncio.ensure_future(stop.wait())
    try:
        done, _ = await asyncio.wait({worker.loaded, stop_task}, return_when=asyncio.FIRST_COMPLETED)
        if worker.loaded in done:
            exc = worker.loaded.exception()
            if exc is not None:
                what = "the stage link failed" if isinstance(exc, Unavailable) and exc.code == "worker_unavailable" else \
                    "the model failed to load"
                raise StartupError(f"{what}: {exc}")
            eng = worker.engine
            # what the start built is never collected again: a request's collections cost what requests keep
            frozen = gc_pauses.freeze_heap()
            log.info("model loaded", model=eng.model_name, n_ctx=eng.n_ctx,
                     load_ms=round(getattr(eng, "load_ms", 0.0), 1), gc_frozen=frozen)
            sd_notify(f"READY=1\nSTATUS=serving {eng.model_name}\nMAINPID={os.getpid()}")
            await stop_task
        log.info("shutting down", running=worker.n_running, waiting=worker.waiting)
        sd_notify("STOPPING=1\nSTATUS=draining")
        force = asyncio.Event()                     # a second SIGTERM / SIGINT: stop the running request now
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, force.set)
        await _drain(worker, cfg.drain_timeout, force)
        return 0
    finally:
        stop_task.cancel()
        if pinger is not None:
            pinger.cancel()
        sweeper.cancel()
        await runner.cleanup()
        worker.stop(timeout=5.0)
        if sock_path is not None:
            with contextlib.suppress(OSError):
                sock_path.unlink()
        log.info("stopped")


async def _drain(worker: EngineWorker, timeout: float, force: asyncio.Event | None = None) -> None:
    """Refuse new work, answer queued requests 503, let the running one finish (cancel it after `timeout` s, or
    at once when `force` is set: a second SIGTERM / SIGINT, as llama.cpp's server and vLLM stop on a second
    Ctrl-C)."""
    for job in worker.begin_shutdown():
        job.events.put_nowait(EngineError(ShuttingDown("the server is shutting down")))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    cancelled = False
    while worker.running is not None:
        if not cancelled and (loop.time() >= deadline or (force is not None and force.is_set())):
            if force is not None and force.is_set():
                log.warning("second signal: cancelling the running request")
            else:
                log.warning("drain timeout: cancelling the running request", timeout_s=timeout)
            for job in worker.active:
                job.cancel()
            cancelled = True
        await asyncio.sleep(0.02)
    await asyncio.sleep(0)  # let handlers write their last events


__all__ = ["serve", "StartupError", "ServeConfig", "ApiError"]
