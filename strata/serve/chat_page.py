"""The web chat page: GET / and the static files under /web/ (strata/serve/web/), with a strict Content-Security-Policy.

The page holds no data (conversations live in the browser's localStorage), so it is served without the API key;
its requests to /v1/... carry the key like any client's. Files are read once, when the app is built: only the
files of strata/serve/web/ with a known type are served, so no request path reaches the file system.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

from aiohttp import web

WEB_DIR = Path(__file__).with_name("web")
PREFIX = "/web/"
CONTENT_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                 ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml", ".txt": "text/plain; charset=utf-8"}
# No inline script or style, nothing from another origin; innerHTML only through DOMPurify's Trusted Types policy.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'; "
       "require-trusted-types-for 'script'; trusted-types dompurify")
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
           "X-Frame-Options": "DENY", "Cache-Control": "no-cache"}
FILES_KEY = web.AppKey("web_files", dict)


def is_public(path: str) -> bool:
    """True for the page's own paths, which need no API key (the page holds no data)."""
    return path == "/" or path.startswith(PREFIX)


def load_files(root: Path = WEB_DIR) -> dict[str, tuple[bytes, str, str]]:
    """Relative path ("chat.js", "vendor/purify.min.js") -> (body, content type, ETag) of each servable file."""
    out = {}
    for f in sorted(root.rglob("*")):
        ctype = CONTENT_TYPES.get(f.suffix)
        if f.is_file() and ctype:
            body = f.read_bytes()
            out[f.relative_to(root).as_posix()] = (body, ctype, '"' + hashlib.sha256(body).hexdigest()[:20] + '"')
    return out


def _serve(request: web.Request, name: str) -> web.Response:
    got = request.app[FILES_KEY].get(name)
    if got is None:
        raise web.HTTPNotFound()
    body, ctype, etag = got
    headers = dict(HEADERS, ETag=etag)
    if request.headers.get("If-None-Match") == etag:
        return web.Response(status=304, headers=headers)
    return web.Response(body=body, headers=dict(headers, **{"Content-Type": ctype}))


async def index(request: web.Request) -> web.Response:
    return _serve(request, "index.html")


async def static(request: web.Request) -> web.Response:
    return _serve(request, request.match_info["name"])


def add_routes(app: web.Application) -> None:
    """Register GET / and GET /web/{name} on `app` (make_app calls this)."""
    app[FILES_KEY] = load_files()
    app.router.add_get("/", index)
    app.router.add_get(PREFIX + "{name:.+}", static)
