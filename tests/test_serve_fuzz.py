"""Hypothesis fuzz of the real daemon: request bodies of the generation routes, slot ids, key headers, and every route
and method the router registers (tests/http_fuzz.py): every input gets a well-formed answer in its API's shape, no
5xx, the engine's state unchanged by refused requests, the daemon alive."""
from __future__ import annotations

import json
import socket
import urllib.parse

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests import http_fuzz  # noqa: E402
from tests.daemon import Daemon, free_port  # noqa: E402
from tests.helpers import full_sweeps  # noqa: E402
from tests.http_fuzz import (FIELDS, MESSAGES_FIELDS, RESPONSES_FIELDS, anytext, junk, mutated, not_null,  # noqa: E402
                             bodies, schemas, valid_chat, valid_completion, valid_messages, valid_responses)

pytestmark = pytest.mark.slow

ROUTES = ["/v1/chat/completions", "/v1/completions"]
API_KEY = "fuzz-key"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    # the Unix socket needs no key (the fuzz of bodies); TCP does (the fuzz of the key headers). The body limit is
    # above the 1 MiB grammar limit, so that a schema can reach it.
    # --n-predict keeps the answers of bodies that give no length short.
    d = Daemon(tmp_path_factory.mktemp("fuzz"), "--queue-max", "4", "--max-body", "3000000", "--api-key", API_KEY,
               "--n-predict", "4", "--embeddings", "--slot-save-path", str(tmp_path_factory.mktemp("fuzz-slots")),
               port=free_port(), n_ctx=256).start()
    yield d
    assert d.stop() == 0, d.log_tail()



def _check_answer(status: int, headers: dict, body: bytes, streamed: bool) -> None:
    assert status in (200, 400, 404, 413, 503), (status, body[:300])
    if status == 200 and headers.get("content-type", "").startswith("text/event-stream"):
        blocks = [b for b in body.decode().split("\n\n") if b]
        assert blocks[-1] == "data: [DONE]", blocks[-3:]
        for b in blocks[:-1]:
            assert b.startswith("data: ")
            json.loads(b[6:])
        return
    d = json.loads(body)
    if status == 200:
        assert d["choices"] and "usage" in d and "timings" in d
    else:
        assert set(d["error"]) == {"message", "type", "param", "code"} and d["error"]["message"]


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(case=st.one_of(st.tuples(st.just("/v1/chat/completions"), mutated(valid_chat)),
                     st.tuples(st.just("/v1/completions"), mutated(valid_completion)),
                     st.tuples(st.sampled_from(ROUTES), bodies)))
def test_fuzz_json_bodies(daemon, case):
    route, body = case
    st_, h, b = daemon.request("POST", route, raw=json.dumps(body).encode(), timeout=60)
    _check_answer(st_, h, b, bool(body.get("stream")))
    if st_ == 200 and not body.get("stream"):       # usage counts every choice (a fuzzed "n" may ask for several)
        d = json.loads(b)
        assert d["usage"]["completion_tokens"] <= body["max_tokens"] * len(d["choices"])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(route=st.sampled_from(ROUTES + ["/slots/0?action=save", "/v1/models", "/nope"]),
       raw=st.binary(max_size=300) | st.text(max_size=200).map(str.encode))
def test_fuzz_raw_bytes(daemon, route, raw):
    st_, h, b = daemon.request("POST", route, raw=raw, timeout=60)
    assert st_ in (400, 404, 405, 413), (st_, b[:200])
    assert json.loads(b)["error"]["message"]


slot_ids = (anytext.filter(bool)
            | st.text(st.characters(categories=["Nd", "No", "Nl"]), min_size=1, max_size=4)   # '²', '٣', 'Ⅻ'
            | st.text(alphabet="0123456789", min_size=1, max_size=5000))                     # past int()'s 4,300


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sid=slot_ids, action=st.sampled_from(["erase", "save", "restore", "nope"]))
def test_fuzz_slot_ids(daemon, sid, action):
    """Any slot id in the path: 200 (slot 0 erased), 400 (not a number, no filename) or 404 (no such slot)."""
    path = f"/slots/{urllib.parse.quote(sid.encode('utf-8', 'surrogatepass'), safe='')}?action={action}"
    st_, h, b = daemon.request("POST", path, timeout=60)
    assert st_ in (200, 400, 404), (st_, b[:200])
    if st_ != 200:
        err = json.loads(b)["error"]
        assert err["message"] and "\n" not in err["message"] and len(err["message"]) < 300, err


def _tcp_get(port: int, path: str, header: bytes) -> tuple[int, bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(b"GET " + path.encode() + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n" + header
                  + b"\r\nConnection: close\r\n\r\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


header_bytes = st.binary(max_size=40).filter(lambda b: not (set(b) & {0, 10, 13}))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from([b"Authorization", b"x-api-key"]),
       value=st.tuples(st.sampled_from([b"Bearer ", b"bearer ", b""]),
                       header_bytes | st.just(API_KEY.encode()) | st.just(API_KEY.encode() + b"\xff")))
def test_fuzz_key_headers(daemon, name, value):
    """Any bytes in the key headers over TCP: 200 for the key, else 401 (or aiohttp's own 400 for a header it
    cannot parse), never a 500."""
    st_, body = _tcp_get(daemon.port, "/v1/models", name + b": " + b"".join(value))
    assert st_ in (200, 400, 401), (st_, body[:200])
    if st_ == 401:
        assert json.loads(body)["error"]["code"] == "invalid_api_key"


def test_health_after_fuzz(daemon):
    st_, d = daemon.json("GET", "/health")
    assert st_ == 200 and d["status"] == "ok"
    assert daemon.proc.poll() is None
    # the fuzz reached the engine, not only the validator (hypothesis's first examples are the simplest bodies)
    assert daemon.metric("strata_generations_total") >= 1
    assert daemon.metric("strata_requests_total", {"status": "200"}) >= 1



def _check_api_answer(route: str, status: int, headers: dict, body: bytes) -> None:
    assert status in (200, 400, 404, 413, 503), (status, body[:300])
    if status == 200 and headers.get("content-type", "").startswith("text/event-stream"):
        events = [b.split("\n", 1) for b in body.decode().split("\n\n") if b]
        for name, data in events:
            assert name.startswith("event: ") and data.startswith("data: ")
            assert json.loads(data[6:])["type"] == name[7:]
        assert events[-1][0][7:] in ("response.completed", "response.incomplete", "response.failed", "message_stop",
                                     "error"), events[-1]
        return
    d = json.loads(body)
    if status == 200:
        assert d["usage"] and (d.get("output") is not None or d.get("content") is not None)
    elif route == "/v1/messages":
        assert d["type"] == "error" and set(d["error"]) == {"type", "message"} and d["error"]["message"]
    else:
        assert set(d["error"]) == {"message", "type", "param", "code"} and d["error"]["message"]


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(case=st.one_of(
    st.tuples(st.just("/v1/responses"), mutated(valid_responses, RESPONSES_FIELDS, "max_output_tokens")),
    st.tuples(st.just("/v1/messages"), mutated(valid_messages, MESSAGES_FIELDS))))
def test_fuzz_responses_and_messages_bodies(daemon, case):
    route, body = case
    st_, h, b = daemon.request("POST", route, raw=json.dumps(body).encode(), timeout=60)
    _check_api_answer(route, st_, h, b)


# ---- structured output and the fields echoed back: every route, streamed and not ------------------------------------
STRUCTURED = {
    "/v1/chat/completions": (valid_chat, {k: FIELDS[k] for k in ("response_format", "tools", "tool_choice")}),
    "/v1/completions": (valid_completion, {k: FIELDS[k] for k in ("json_schema", "grammar", "response_format")}),
    "/v1/responses": (valid_responses, {k: RESPONSES_FIELDS[k] for k in ("text", "metadata", "tools")}),
    "/v1/messages": (valid_messages, {k: MESSAGES_FIELDS[k] for k in ("output_config", "tools")}),
}


@st.composite
def structured_case(draw):
    route = draw(st.sampled_from(sorted(STRUCTURED)))
    base, fields = STRUCTURED[route]
    body = dict(draw(base), stream=draw(st.booleans()))
    for key in draw(st.lists(st.sampled_from(sorted(fields)), min_size=1, max_size=2, unique=True)):
        body[key] = draw(fields[key])
    return route, body


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=structured_case())
def test_fuzz_structured_output_and_echoed_fields(daemon, case):
    """Schemas, grammars, tools and metadata of any content (lone surrogates, a grammar past 1 MiB): 200 or a 400 in
    the route's API's shape."""
    route, body = case
    st_, h, b = daemon.request("POST", route, raw=json.dumps(body).encode(), timeout=60)
    if route in ("/v1/responses", "/v1/messages"):
        _check_api_answer(route, st_, h, b)
    else:
        _check_answer(st_, h, b, bool(body.get("stream")))


BIG_SCHEMA = {"type": "string", "enum": [f"v{i}" for i in range(150_000)]}     # a grammar of about 1.4 M characters


@pytest.mark.parametrize("route,body,param", [
    ("/v1/completions", {"prompt": "hi", "json_schema": BIG_SCHEMA}, "json_schema"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                                         "schema": BIG_SCHEMA}}},
     "response_format"),
    ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}],
                      "output_config": {"format": {"type": "json_schema", "schema": BIG_SCHEMA}}},
     "output_config.format"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_a_schema_past_the_grammar_limit_gets_400(daemon, route, body, param, stream):
    """The 1 MiB limit on a grammar holds for the grammar a schema compiles to: a 400 naming the field (as it is
    for 'grammar'), not a 500."""
    st_, h, b = daemon.request("POST", route, raw=json.dumps(dict(body, max_tokens=2, stream=stream)).encode(),
                               timeout=60)
    assert st_ == 400, b[:300]
    msg = json.loads(b)["error"]["message"]
    assert msg.startswith(f"'{param}': the grammar has ") and "at most 1048576 are allowed" in msg, msg


# ---- every route and method the router registers (tests/http_fuzz.py) ---------------------------------------------
ROUTE_TABLE = http_fuzz.route_table()


@pytest.fixture(scope="module")
def router_fuzz(daemon):
    return http_fuzz.FuzzRun(daemon).start()


def test_the_route_table_is_the_routers():
    """The fuzz reads the routes from the application (make_app), so that a route added later is fuzzed too."""
    table = set(ROUTE_TABLE)
    assert {("POST", "/v1/chat/completions"), ("GET", "/v1/models/{model}"), ("POST", "/slots/{slot}"),
            ("POST", "/api/chat"), ("*", "/api/pull"), ("HEAD", "/health")} <= table
    assert len(table) >= 50


# CI: 1,500 cases (about 25 per route); make test-sweeps: 3,000; tools/fuzz_http.py runs the long fuzz (100,000)
@settings(max_examples=3000 if full_sweeps() else 1500, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(case=http_fuzz.cases(ROUTE_TABLE))
def test_fuzz_every_route(router_fuzz, case):
    """Any method, path, query, headers (odd encodings, huge values) and body (shaped by the route's schema, valid
    or broken): below 500 but Ollama's documented 501s, errors as JSON in the API's shape (aiohttp's own 400 for
    malformed HTTP included), a refused request leaves the engine's state as it was, the daemon lives."""
    problem = router_fuzz.check(case)
    assert problem is None, (problem, case.short())


def test_reference_conversation_unchanged_by_the_router_fuzz(router_fuzz, daemon):
    assert router_fuzz.reference_problem() is None
    assert daemon.proc.poll() is None


def test_no_request_failed_after_fuzz(daemon):
    """No fuzzed request reached the middleware's catch-all (a 500 with a traceback in the log), and nothing but the
    daemon's JSON lines reached its stderr (a Python warning, such as numpy's divide-by-zero for a temperature too
    small for float32, is written raw)."""
    raw = [ln for ln in daemon.log_path.read_text().splitlines() if ln.strip() and not ln.startswith("{")]
    assert not raw, raw[:6]
    lines = [json.loads(ln) for ln in daemon.log_path.read_text().splitlines() if ln.startswith("{")]
    failed = [ln for ln in lines if ln.get("event") == "request failed" or "exception" in ln]
    assert not failed, failed[:3]
    assert daemon.json("GET", "/health")[0] == 200
