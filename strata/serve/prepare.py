"""Where a request's CPU-heavy preparation runs (its body's JSON parse and the route's validation, the chat template's
render and tokenizing, a grammar's compile): off the event loop, in the preparation pool, a few threads whose calls
in flight are bounded, so /health and the streams of other requests keep answering while a multi-megabyte request is
prepared. A request whose body is small is prepared on the loop, where a thread hop costs more than the work.

The pool takes at most --queue-max + the engine's request slots calls at once (running or waiting for a thread): one
more is a 503 (queue_full), as a request past the engine's queue is, so clients cannot pile up work the engine could
not take anyway. Python code in a pool thread gives the interpreter lock back every switch interval
(strata.serve.server.GIL_SWITCH_S), so the loop runs between its steps; one long call into C that keeps the lock
(json.loads of a whole body) still holds the loop for its length.
"""
from __future__ import annotations

import asyncio
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from aiohttp import web

from strata.serve.errors import ApiError

#: a body of fewer bytes is parsed and validated on the event loop (about a millisecond of work at most); a larger one,
#: and everything its request prepares after (plan, render, tokenize), in the pool
SMALL_BODY = 64 << 10
#: threads of the pool: Python work shares one interpreter lock, so more would mostly wait; the tokenizer and the
#: template's C parts run beside them
THREADS = min(4, os.cpu_count() or 1)
HEAVY = "prepare_heavy"            # request key: True when this request's preparation runs in the pool


class PrepPool:
    """The preparation pool: THREADS threads, at most cap() calls in flight (running or waiting for a thread)."""

    def __init__(self, cap: Callable[[], int], threads: int = THREADS):
        self._cap = cap
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="strata-prep")
        self._lock = threading.Lock()
        self.in_flight = 0

    async def run(self, fn: Callable[[], Any]) -> Any:
        """fn() on a pool thread; its result, or its exception (an ApiError stays the same ApiError). 503 (queue_full)
        when cap() calls are already in flight, or the pool is shut down. A call cancelled while it waits for a
        thread does not run; one already running finishes and counts until it does."""
        with self._lock:
            cap = self._cap()
            if self.in_flight >= cap:
                raise ApiError(503, f"the server is busy: {self.in_flight} requests are being prepared, at most {cap} "
                                    f"at once (--queue-max and the request slots); retry later", code="queue_full",
                               headers={"Retry-After": "1"})
            self.in_flight += 1
        try:
            fut = self._pool.submit(fn)
        except RuntimeError:             # shut down: the daemon is stopping
            self._done(None)
            raise ApiError(503, "the server is shutting down", code="shutting_down",
                           headers={"Retry-After": "5"}) from None
        fut.add_done_callback(self._done)
        return await asyncio.wrap_future(fut)

    def _done(self, _fut) -> None:
        with self._lock:
            self.in_flight -= 1

    def shutdown(self) -> None:
        """Take no more calls; those queued are dropped, those running finish on their own."""
        self._pool.shutdown(wait=False, cancel_futures=True)


PREP_KEY = web.AppKey("prepare", PrepPool)


def mark_heavy(request: web.Request) -> None:
    """Prepare the rest of this request in the pool (its body was large, or it grew: a stored conversation)."""
    request[HEAVY] = True


def is_heavy(request: web.Request) -> bool:
    return bool(request.get(HEAVY, False))


async def prepared(request: web.Request, fn: Callable[[], Any], *, heavy: bool | None = None) -> Any:
    """fn()'s result: computed in the pool when `heavy` (default: is_heavy(request)), else here on the loop."""
    if not (is_heavy(request) if heavy is None else heavy):
        return fn()
    return await request.app[PREP_KEY].run(fn)


def add_pool(app: web.Application, cap: Callable[[], int]) -> None:
    """The application's pool (calls in flight bounded by cap()), shut down with the application."""
    pool = app[PREP_KEY] = PrepPool(cap)

    async def close(_app):
        pool.shutdown()
    app.on_cleanup.append(close)
