"""What one client may hold of the daemon (strata/serve/connections.py, the request budgets): connections per
listener, a header or body that never arrives, idle connections, a generation's wall time and token budget."""
from __future__ import annotations

import json
import socket
import time

import pytest

from strata.serve.connections import ConnectionGuard, connection_cap
from tests.daemon import Daemon, free_port

HI = [{"role": "user", "content": "Hi"}]


def _closed_within(s: socket.socket, seconds: float) -> bytes | None:
    """What the server sent before closing `s` (b"" when nothing), or None when it is still open after `seconds`."""
    s.settimeout(0.25)
    got = b""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            chunk = s.recv(65536)
        except socket.timeout:
            continue
        except OSError:
            return got
        if not chunk:
            return got
        got += chunk
    return None


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("limits"), "--max-connections", "4", "--header-timeout", "1",
               "--body-timeout", "1", "--idle-timeout", "2", "--max-request-tokens", "600",
               port=free_port()).start()
    yield d
    assert d.stop() == 0, d.log_tail()


def _tcp(d: Daemon) -> socket.socket:
    return socket.create_connection(("127.0.0.1", d.port), timeout=5)


def test_a_listener_full_of_idle_connections_refuses_the_next_and_the_socket_still_answers(daemon):
    held = [_tcp(daemon) for _ in range(4)]
    try:
        extra = _tcp(daemon)
        got = _closed_within(extra, 10)
        assert got is not None and got.startswith(b"HTTP/1.1 503") and b"--max-connections" in got
        st, h = daemon.json("GET", "/health")        # the Unix socket is another listener: it answers
        assert st == 200
        st, s = daemon.json("GET", "/status")
        assert s["connections"]["max_per_listener"] == 4 and s["connections"]["refused"] >= 1
    finally:
        for s in held:
            s.close()


def test_idle_and_dribbled_headers_are_closed(daemon):
    def closed_slow():
        return daemon.json("GET", "/status")[1]["connections"]["closed_slow"]
    n0 = closed_slow()
    idle = _tcp(daemon)
    assert _closed_within(idle, 15) is not None          # sent nothing: closed after --idle-timeout (by aiohttp's
    n1 = closed_slow()                                   # keep-alive timer or the guard, whichever looks first)
    slow = _tcp(daemon)
    slow.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")   # the header never ends
    assert _closed_within(slow, 15) is not None
    assert closed_slow() == n1 + 1, (n0, n1)            # the guard: its header was not in after --header-timeout


def test_a_body_that_never_arrives_gets_408(daemon):
    s = _tcp(daemon)
    body = json.dumps({"messages": HI, "max_tokens": 2}).encode()
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body[:5])
    got = _closed_within(s, 15)
    assert got is not None and got.startswith(b"HTTP/1.1 408") and b"--body-timeout" in got


def test_a_client_gone_before_its_body_arrived_is_a_499_not_a_server_error(daemon):
    """A client that closes (TCP: resets) its connection halfway through its body failed nothing on the server: no
    error logged, no 500 counted in /metrics, a 499 'request cancelled' on each route that reads a body."""
    import struct
    routes = ["/v1/chat/completions", "/v1/completions", "/completion", "/v1/responses", "/v1/messages", "/api/chat",
              "/slots/0?action=save"]
    before = daemon.metric("strata_requests_total", {"status": "500"})
    cancelled = daemon.metric("strata_requests_total", {"status": "499"})
    for i, route in enumerate(routes):
        s = _tcp(daemon)
        s.sendall(f"POST {route} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  f"Content-Length: 400\r\n\r\n{{\"messages\": [".encode())
        time.sleep(0.2)                             # the handler is waiting on the rest of the body
        if i % 2:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))      # a reset
        s.close()
    deadline = time.monotonic() + 10
    while daemon.metric("strata_requests_total", {"status": "499"}) < cancelled + len(routes):
        assert time.monotonic() < deadline, daemon.log_tail()
        time.sleep(0.1)
    assert daemon.metric("strata_requests_total", {"status": "500"}) == before
    failed = [ln for ln in daemon.log_lines() if ln.get("event") == "request failed" or ln.get("level") == "error"]
    assert not failed, failed
    assert daemon.request("GET", "/health")[0] == 200


def test_keep_alive_between_requests_works_within_the_idle_timeout(daemon):
    import http.client
    c = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=30)
    for _ in range(3):
        c.request("GET", "/health")
        r = c.getresponse()
        assert r.status == 200
        r.read()
    c.close()


def test_n_times_max_tokens_is_capped(daemon):
    st, d = daemon.json("POST", "/v1/chat/completions", {"messages": HI, "n": 4, "max_tokens": 200})
    assert st == 400 and "--max-request-tokens (600)" in d["error"]["message"] and d["error"]["param"] == "max_tokens"
    st, d = daemon.json("POST", "/v1/chat/completions", {"messages": HI, "n": 2, "max_tokens": 3, "temperature": 0})
    assert st == 200 and len(d["choices"]) == 2


def test_tokenize_is_queued_with_the_model_work(daemon):
    st, d = daemon.json("POST", "/tokenize", {"content": "hello world"})
    assert st == 200 and d["tokens"]
    st, d = daemon.json("POST", "/tokenize", {"content": "\ud800"})
    assert st == 400 and "lone surrogate" in d["error"]["message"]


def test_a_generation_past_its_wall_time_ends_with_length(tmp_path):
    d = Daemon(tmp_path, "--max-request-seconds", "0.000001").start()
    try:
        st, r = d.json("POST", "/v1/completions", {"prompt": "1, 2, 3,", "max_tokens": 50, "temperature": 0})
        assert st == 200 and r["choices"][0]["finish_reason"] == "length"
        assert r["usage"]["completion_tokens"] < 50
    finally:
        assert d.stop() == 0, d.log_tail()


def test_the_guard_closes_only_what_is_late():
    class T:
        def __init__(self, sockname):
            self.sockname, self.closed, self.out = sockname, False, b""

        def get_extra_info(self, k):
            return self.sockname

        def write(self, b):
            self.out += b

        def close(self):
            self.closed = True

    g = ConnectionGuard(max_connections=2, header_timeout=5, idle_timeout=10)
    a, b, c = T(("127.0.0.1", 1)), T(("127.0.0.1", 1)), T(("127.0.0.1", 1))
    assert g.opened(a) and g.opened(b) and not g.opened(c) and c.closed and c.out.startswith(b"HTTP/1.1 503")
    u = T("/run/s.sock")
    assert g.opened(u)                                   # another listener: its own count
    t0 = g.conns[a].opened
    g.received(a)                                        # a request starts arriving on a
    g.begin(b)                                           # b has one in hand
    assert g.sweep(t0 + 6) == 1 and a.closed             # a's header is late; b is busy; u idle for 6 s only
    g.end(b)
    assert g.sweep(t0 + 9) == 0
    assert g.sweep(g.conns[b].idle_since + 11) == 2 and b.closed and u.closed


def test_the_connection_cap_fits_the_descriptor_limit():
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    cap = connection_cap(10 ** 9, 2)
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    assert soft == resource.RLIM_INFINITY or 2 * cap + 64 <= soft
    assert connection_cap(3, 2) <= 3
