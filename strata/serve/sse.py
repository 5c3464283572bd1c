"""Named server-sent events (`event:` and `data:` lines) for the Responses and Messages streams."""
from __future__ import annotations

import json

import structlog
from aiohttp import web

from strata.serve.config import WORKER_KEY
from strata.serve.errors import ApiError

log = structlog.get_logger("strata.serve")


def frame(event: str, data: dict) -> bytes:
    return f"event: {event}\ndata: ".encode() + json.dumps(data, ensure_ascii=False).encode() + b"\n\n"


async def send_events(request: web.Request, job, events, on_error) -> web.StreamResponse:
    """Send the (event, data) pairs of the async iterator `events` as SSE. The response is prepared at the first
    pair, so an error before it (the queue, the engine refusing the request) is an ordinary HTTP error; an ApiError
    after it ends the stream with the pairs of on_error(e). A client that goes away stops the generation (`job`)."""
    resp: web.StreamResponse | None = None
    try:
        try:
            async for name, data in events:
                if resp is None:
                    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                                       "Cache-Control": "no-cache", "X-Request-Id": request["rid"],
                                                       "X-Accel-Buffering": "no"})
                    await resp.prepare(request)
                await resp.write(frame(name, data))
        except ApiError as e:
            if resp is None:
                raise
            for name, data in on_error(e):
                await resp.write(frame(name, data))
        await resp.write_eof()
        return resp
    except (ConnectionResetError, ConnectionError) as e:
        log.info("client disconnected mid-stream", error=str(e) or type(e).__name__)
        request.app[WORKER_KEY].drop(job)
        return resp if resp is not None else web.Response(status=499)
