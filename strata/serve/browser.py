"""What a web page may ask of the TCP listener. Keyless (no --api-key, where any page the browser shows can reach a
loopback daemon): requests whose Host is not this server's are refused (DNS rebinding), a cross-origin Origin may
not change state unless --cors-origin names it, and a body is read as JSON only when it says so, says nothing, or
is curl's default form type with no foreign Origin. With a key, a page cannot authenticate without it, so only the
CORS answers apply: preflights and headers for the origins --cors-origin names. The Unix socket is exempt: its file
mode is the boundary."""
from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from aiohttp import web

from strata.serve.errors import ApiError
from strata.serve.handling import is_unix

LOOPBACK_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback")
SAFE_METHODS = ("GET", "HEAD", "OPTIONS")
JSON_TYPES = ("application/json", "")
CURL_FORM = "application/x-www-form-urlencoded"


def _host_only(host: str) -> str:
    """'name:port', '[v6]:port', 'v6' -> the host, lower case, without brackets or port."""
    h = host.strip().lower()
    if h.startswith("["):
        return h[1:h.find("]")] if "]" in h else h
    if h.count(":") == 1:
        return h.split(":", 1)[0]
    return h


def _is_loopback(name: str) -> bool:
    if name in LOOPBACK_NAMES or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


class BrowserPolicy:
    """The checks above, for a TCP listener on `listen_host` with the extra host names `allowed_hosts` and the
    cross-origin origins `cors_origins` ("*": any)."""

    def __init__(self, listen_host: str | None, allowed_hosts=(), cors_origins=(), keyed: bool = False):
        self.keyed = keyed
        self.hosts = {_host_only(h) for h in allowed_hosts if h.strip()}
        if listen_host and not ipaddress_unspecified(listen_host):
            self.hosts.add(_host_only(listen_host))
        self.any_host = "*" in self.hosts
        self.origins = {o.strip().rstrip("/").lower() for o in cors_origins if o.strip()}

    def host_ok(self, host: str | None) -> bool:
        if host is None:
            return False
        name = _host_only(host)
        return self.any_host or _is_loopback(name) or name in self.hosts

    def cross_origin(self, request: web.Request) -> str | None:
        """The request's Origin when it is not this server's own (scheme://Host), else None."""
        origin = request.headers.get("Origin")
        if origin is None:
            return None
        o = origin.strip().rstrip("/").lower()
        if o == "null":
            return o
        parts = urlsplit(o)
        if parts.netloc and parts.netloc == (request.host or "").lower():
            return None
        return o

    def cors_allowed(self, origin: str) -> bool:
        return "*" in self.origins or origin in self.origins

    def middleware(self):
        @web.middleware
        async def browser(request: web.Request, handler):
            if is_unix(request):
                return await handler(request)
            foreign = self.cross_origin(request)
            allowed = foreign is not None and self.cors_allowed(foreign)
            if request.method == "OPTIONS" and allowed:        # a CORS preflight from an origin --cors-origin names
                return web.Response(status=204, headers=_cors_headers(request, preflight=True))
            if self.keyed:
                return await handler(request)
            if not self.host_ok(request.headers.get("Host")):
                raise ApiError(403, f"the Host header {request.headers.get('Host')!r} is not this server's: use a "
                                    "loopback name, the --host address or a name given with --allowed-hosts",
                               code="host_not_allowed")
            if foreign is not None and not allowed and request.method not in SAFE_METHODS:
                raise ApiError(403, f"cross-origin requests from {foreign!r} may not change anything here "
                                    "(--cors-origin allows an origin)", code="origin_not_allowed")
            if request.method not in SAFE_METHODS and request.body_exists:
                ctype = request.content_type if "Content-Type" in request.headers else ""
                if ctype not in JSON_TYPES and not (ctype == CURL_FORM and foreign is None):
                    raise ApiError(415, f"the body's Content-Type is {ctype!r}: send application/json",
                                   code="unsupported_media_type")
            return await handler(request)
        return browser

    async def on_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        """aiohttp's on_response_prepare: CORS headers on every answer to an origin --cors-origin names (streamed
        ones and errors, a 401 included, so the page can read them)."""
        if self.origins and not is_unix(request):
            foreign = self.cross_origin(request)
            if foreign is not None and self.cors_allowed(foreign):
                response.headers.update(_cors_headers(request, preflight=False))


def ipaddress_unspecified(host: str) -> bool:
    """0.0.0.0 / :: (every address): no name of its own to allow."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return False


def _cors_headers(request: web.Request, preflight: bool) -> dict[str, str]:
    h = {"Access-Control-Allow-Origin": request.headers.get("Origin", "*"), "Vary": "Origin"}
    if preflight:
        h.update({"Access-Control-Allow-Methods": "GET, POST, DELETE, OPTIONS",
                  "Access-Control-Allow-Headers": request.headers.get("Access-Control-Request-Headers",
                                                                      "Authorization, Content-Type, x-api-key"),
                  "Access-Control-Max-Age": "600"})
    return h
