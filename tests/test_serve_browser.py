"""A web page against the keyless TCP daemon (strata/serve/browser.py): a foreign Host (DNS rebinding) is refused, a
foreign Origin changes nothing, text/plain and form bodies are not read as JSON from a page, --cors-origin and
--allowed-hosts open what they name; the Unix socket is exempt. And what a client that reaches the wrong route, method
or content type gets: one JSON error shape per API family (aiohttp's own 400 for malformed HTTP included)."""
from __future__ import annotations

import http.client
import json
import socket

import pytest

from tests.daemon import Daemon, free_port

HI = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("browser"), "--cors-origin", "https://app.example",
               "--allowed-hosts", "strata.lan", port=free_port()).start()
    yield d
    assert d.stop() == 0, d.log_tail()


def tcp(d: Daemon, method: str, path: str, body=None, headers: dict | None = None):
    c = http.client.HTTPConnection("127.0.0.1", d.port, timeout=120)
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    h = {"Content-Type": "application/json"} if data is not None else {}
    h.update(headers or {})
    c.request(method, path, body=data, headers=h)
    r = c.getresponse()
    raw = r.read()
    c.close()
    return r.status, dict(r.getheaders()), (json.loads(raw) if raw and raw[:1] in b"{[" else raw)


def test_a_foreign_host_is_refused_on_tcp_and_the_socket_is_exempt(daemon):
    st, _, d = tcp(daemon, "GET", "/v1/models", headers={"Host": "evil.example"})
    assert st == 403 and d["error"]["code"] == "host_not_allowed"
    for host in (f"127.0.0.1:{daemon.port}", f"localhost:{daemon.port}", "strata.lan", f"[::1]:{daemon.port}"):
        st, _, _ = tcp(daemon, "GET", "/v1/models", headers={"Host": host})
        assert st == 200, host
    st, _ = daemon.json("GET", "/v1/models", headers={"Host": "evil.example"})
    assert st == 200


def test_a_foreign_origin_changes_nothing(daemon):
    st, _ = daemon.json("POST", "/v1/chat/completions", HI)
    assert st == 200
    st, _, d = tcp(daemon, "POST", "/slots/0?action=erase", {}, headers={"Origin": "http://evil.example"})
    assert st == 403 and d["error"]["code"] == "origin_not_allowed"
    assert daemon.json("GET", "/status")[1]["engine"]["pos"] > 0            # the conversation is still there
    st, _, _ = tcp(daemon, "POST", "/v1/chat/completions", HI, headers={"Origin": f"http://127.0.0.1:{daemon.port}"})
    assert st == 200                                                       # the chat page's own origin
    st, h, _ = tcp(daemon, "GET", "/v1/models", headers={"Origin": "http://evil.example"})
    assert st == 200 and "Access-Control-Allow-Origin" not in h           # a page can send it, never read it


def test_only_json_bodies_are_read(daemon):
    raw = json.dumps(HI).encode()
    st, _, d = tcp(daemon, "POST", "/v1/chat/completions", raw, headers={"Content-Type": "text/plain"})
    assert st == 415 and "application/json" in d["error"]["message"]
    st, _, _ = tcp(daemon, "POST", "/v1/chat/completions", raw,
                   headers={"Content-Type": "application/x-www-form-urlencoded"})    # curl -d '{...}'
    assert st == 200
    st, _, d = tcp(daemon, "POST", "/v1/chat/completions", raw,
                   headers={"Content-Type": "application/x-www-form-urlencoded", "Origin": "http://evil.example"})
    assert st == 403
    c = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=120)
    c.putrequest("POST", "/v1/chat/completions")                          # no Content-Type at all
    c.putheader("Content-Length", str(len(raw)))
    c.endheaders(raw)
    assert c.getresponse().status == 200
    c.close()


def test_cors_origin_gets_preflight_and_headers_streamed_too(daemon):
    origin = "https://app.example"
    st, h, _ = tcp(daemon, "OPTIONS", "/v1/chat/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type, authorization"})
    assert st == 204 and h["Access-Control-Allow-Origin"] == origin and "POST" in h["Access-Control-Allow-Methods"]
    st, h, _ = tcp(daemon, "POST", "/v1/chat/completions", HI, headers={"Origin": origin})
    assert st == 200 and h["Access-Control-Allow-Origin"] == origin
    st, h, body = tcp(daemon, "POST", "/v1/chat/completions", {**HI, "stream": True}, headers={"Origin": origin})
    assert st == 200 and h["Access-Control-Allow-Origin"] == origin and b"[DONE]" in body


def test_a_keyed_wildcard_listener_answers_its_own_addresses_and_cors_preflights(tmp_path):
    """With --api-key a page cannot authenticate without the key: any Host is served (a --host 0.0.0.0 daemon is
    reached by its real address), and a CORS preflight from a --cors-origin origin is answered without the key, as
    browsers send it; its 401s carry the CORS headers so the page can read them."""
    d = Daemon(tmp_path, "--api-key", "k", "--cors-origin", "https://app.example", port=free_port()).start()
    try:
        st, _, _ = tcp(d, "GET", "/v1/models", headers={"Host": "192.0.2.7:8080", "Authorization": "Bearer k"})
        assert st == 200
        st, h, _ = tcp(d, "OPTIONS", "/v1/chat/completions", headers={
            "Origin": "https://app.example", "Access-Control-Request-Method": "POST"})
        assert st == 204 and h["Access-Control-Allow-Origin"] == "https://app.example"
        st, h, _ = tcp(d, "POST", "/v1/chat/completions", HI, headers={"Origin": "https://app.example"})
        assert st == 401 and h["Access-Control-Allow-Origin"] == "https://app.example"
        st, h, _ = tcp(d, "POST", "/v1/chat/completions", HI, headers={"Origin": "https://app.example",
                                                                       "Authorization": "Bearer k"})
        assert st == 200 and h["Access-Control-Allow-Origin"] == "https://app.example"
    finally:
        assert d.stop() == 0, d.log_tail()


# ---- error shapes: one per API family on every route ----------------------------------------------------------------
def _is_llama(d, status):
    return set(d["error"]) == {"code", "message", "type"} and d["error"]["code"] == status


def _is_openai(d):
    return set(d["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("method,path,ctype,status,shape", [
    ("GET", "/completion", "application/json", 405, "llama"),          # a method the route does not take
    ("POST", "/completion", "text/plain", 415, "llama"),               # a content type that is not JSON
    ("POST", "/tokenize", "text/plain", 415, "llama"),
    ("PUT", "/props", "application/json", 405, "llama"),
    ("GET", "/api/nope", "application/json", 404, "ollama"),           # an unknown route under /api/
    ("POST", "/api/chat/x", "application/json", 404, "ollama"),
    ("POST", "/api/chat", "text/plain", 415, "ollama"),
    ("GET", "/v1/messages", "application/json", 405, "anthropic"),
    ("POST", "/v1/messages/nope", "application/json", 404, "anthropic"),
    ("GET", "/v1/chat/completions", "application/json", 405, "openai"),
    ("POST", "/v1/nope", "application/json", 404, "openai"),
])
def test_each_api_family_answers_errors_in_its_shape(daemon, method, path, ctype, status, shape):
    st, h, d = tcp(daemon, method, path, b"{}", headers={"Content-Type": ctype})
    assert st == status and h["Content-Type"].startswith("application/json"), (st, d)
    if shape == "llama":
        assert _is_llama(d, status), d
    elif shape == "ollama":
        assert set(d) == {"error"} and isinstance(d["error"], str) and d["error"], d
    elif shape == "anthropic":
        assert d["type"] == "error" and set(d["error"]) == {"type", "message"}, d
    else:
        assert _is_openai(d), d


def _raw_tcp(port: int, data: bytes) -> tuple[int, dict, bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(data)
        r = http.client.HTTPResponse(s)
        r.begin()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()


@pytest.mark.parametrize("data,why", [
    (b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Bad: a\x01b\r\n\r\n", "Invalid header value char"),
    (b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"x" * 20000 + b"\r\n\r\n", "8190 bytes"),
    (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n", "HTTPS traffic"),   # a TLS hello
    (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
     "chunk"),
])
def test_malformed_http_gets_a_json_400_and_one_log_line(daemon, data, why):
    """aiohttp's own answer to HTTP it cannot parse, as JSON in OpenAI's shape (no route was read), logged as one
    warning line rather than an error-level traceback."""
    n_before = len(daemon.log_lines())
    st, h, b = _raw_tcp(daemon.port, data)
    assert st == 400 and h["content-type"].startswith("application/json"), (st, b[:200])
    err = json.loads(b)["error"]
    assert _is_openai({"error": err}) and err["code"] == "bad_http" and "\n" not in err["message"], err
    assert why.lower() in err["message"].lower(), err
    lines = daemon.log_lines()[n_before:]
    assert not [ln for ln in lines if ln.get("level") in ("error", "critical") or "exception" in ln], lines
    assert any(ln.get("event", "").startswith("malformed HTTP request") and ln["level"] == "warning"
               for ln in lines), lines
    assert daemon.json("GET", "/health")[0] == 200
