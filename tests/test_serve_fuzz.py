"""Hypothesis fuzz of request bodies against the real daemon: every input gets well-formed JSON, /health survives."""
from __future__ import annotations

import json
import socket
import urllib.parse

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests.daemon import Daemon, free_port  # noqa: E402

pytestmark = pytest.mark.slow

ROUTES = ["/v1/chat/completions", "/v1/completions"]
API_KEY = "fuzz-key"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    # the Unix socket needs no key (the fuzz of bodies); TCP does (the fuzz of the key headers). The body limit is
    # above the 1 MiB grammar limit, so that a schema can reach it.
    d = Daemon(tmp_path_factory.mktemp("fuzz"), "--queue-max", "4", "--max-body", "3000000", "--api-key", API_KEY,
               port=free_port(), n_ctx=256).start()
    yield d
    assert d.stop() == 0, d.log_tail()


# text, and text with lone surrogates among its characters (JSON's "\ud800" decodes to one; st.text never draws them)
anytext = st.text(max_size=20) | st.lists(st.characters(codec="utf-8") | st.characters(categories=["Cs"]),
                                          max_size=20).map("".join)
junk = st.recursive(
    st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats(allow_nan=False) | anytext,
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(anytext.filter(lambda k: len(k) <= 8), kids,
                                                              max_size=4),
    max_leaves=12)
# JSON schemas: small ones of any content, and ones whose grammar is past the 1 MiB limit
schemas = st.fixed_dictionaries(
    {"type": st.sampled_from(["string", "object", "integer", "array"]) | junk},
    optional={"enum": st.lists(anytext | junk, max_size=3), "properties": st.dictionaries(anytext, junk, max_size=3),
              "items": junk, "required": st.lists(anytext, max_size=2)}) \
    | st.integers(80_000, 120_000).map(lambda n: {"type": "string", "enum": [f"v{i}" for i in range(n)]}) | junk
tools = st.lists(st.fixed_dictionaries({"type": st.just("function"),
                                        "function": st.fixed_dictionaries(
                                            {"name": st.sampled_from(["f", "g"]) | anytext},
                                            optional={"description": anytext, "parameters": schemas})}),
                 max_size=2) | junk

message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "developer", "wizard"]) | junk,
     "content": st.text(max_size=40) | st.lists(st.fixed_dictionaries({"type": st.just("text"),
                                                                         "text": st.text(max_size=10)}), max_size=2)
     | junk})

FIELDS = {
    "messages": st.lists(message, min_size=0, max_size=4) | junk,
    "prompt": st.text(max_size=60) | st.lists(st.integers(-5, 60000), max_size=8) | junk,
    "temperature": st.floats(-1, 3, allow_nan=False) | junk,
    "top_p": st.floats(-0.5, 1.5, allow_nan=False) | junk,
    "top_k": st.integers(-3, 100) | junk,
    "min_p": st.floats(-0.5, 1.5, allow_nan=False) | junk,
    "seed": st.integers(-3, 2 ** 65) | junk,
    "stop": st.text(max_size=5) | st.lists(st.text(max_size=5), max_size=20) | junk,
    "presence_penalty": st.floats(-3, 3, allow_nan=False) | junk,
    "frequency_penalty": st.floats(-3, 3, allow_nan=False) | junk,
    "repeat_last_n": st.integers(-3, 100) | junk,
    "logprobs": st.booleans() | st.integers(-2, 25) | junk,
    "top_logprobs": st.integers(-2, 25) | junk,
    "n": st.integers(0, 3) | junk,
    "stream": st.booleans() | junk,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | junk,
    "model": st.sampled_from(["SmolLM2-135M-Instruct.Q4_1", "default", "gpt-4"]) | junk,
    "cache_prompt": st.booleans() | junk,
    "strata_checkpoint": st.booleans() | junk,
    "strata_pin": st.integers(-2, 6) | junk,
    "response_format": st.fixed_dictionaries({"type": st.just("json_schema"),
                                              "json_schema": st.fixed_dictionaries({"name": st.just("x"),
                                                                                    "schema": schemas})})
    | st.fixed_dictionaries({"type": st.sampled_from(["json_object", "text"]) | junk}, optional={"schema": schemas})
    | junk,
    "json_schema": schemas,
    "grammar": st.sampled_from(['root ::= "yes" | "no"', "root ::= [0-9]+"]) | anytext | junk,
    "tools": tools,
    "tool_choice": st.sampled_from(["auto", "none", "required"]) | junk,
}

not_null = junk.filter(lambda v: v is not None)                  # max_tokens: null would mean "no limit"
text = st.text(st.characters(codec="utf-8"), max_size=40)
VALID = {
    "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "top_k": st.integers(0, 100),
    "min_p": st.floats(0, 1), "seed": st.integers(0, 2 ** 32), "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2), "stop": text.filter(bool) | st.lists(text.filter(bool), max_size=3),
    "stream": st.booleans(), "cache_prompt": st.booleans(), "strata_checkpoint": st.booleans(),
    "model": st.sampled_from(["SmolLM2-135M-Instruct.Q4_1", "default"]), "n": st.just(1),
}
valid_chat = st.fixed_dictionaries(
    {"messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                                 "content": text}), min_size=1, max_size=3),
     "max_tokens": st.integers(0, 3)},
    optional=dict(VALID, logprobs=st.booleans()))
valid_completion = st.fixed_dictionaries(
    {"prompt": text.filter(bool) | st.lists(st.integers(0, 49151), min_size=1, max_size=8),
     "max_tokens": st.integers(0, 3)},
    optional=dict(VALID, logprobs=st.integers(0, 5)))


@st.composite
def mutated(draw, base, fields=FIELDS, limit="max_tokens"):
    """A valid body with up to two fields replaced by anything (or removed); `limit` (the length field) is only
    replaced, never removed or null."""
    body = dict(draw(base))
    for _ in range(draw(st.integers(0, 2))):
        key = draw(st.sampled_from(sorted(set(fields) | set(body))))
        if key == limit or draw(st.booleans()):
            body[key] = draw(fields.get(key, junk) if key != limit else st.integers(-2, 3) | not_null)
        else:
            body.pop(key, None)
    return body


bodies = st.fixed_dictionaries(
    {"max_tokens": st.integers(-2, 3) | not_null},               # always present: generations stay short
    optional=FIELDS)


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


# ---- the Responses and Messages routes: every body answers 200 or an error in the route's API's shape -------------
input_item = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool"]) | junk,
     "content": text | st.lists(st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text",
                                                                                 "input_image"]),
                                                        "text": text}), max_size=2) | junk},
    optional={"type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning"]) | junk,
              "call_id": text | junk, "name": text | junk, "arguments": text | junk, "output": text | junk})
RESPONSES_FIELDS = {
    "input": text | st.lists(input_item, max_size=3) | junk, "instructions": text | junk,
    "previous_response_id": text | junk, "store": st.booleans() | junk, "stream": st.booleans() | junk,
    "temperature": st.floats(-1, 3, allow_nan=False) | junk, "top_p": st.floats(-0.5, 1.5, allow_nan=False) | junk,
    "tools": st.lists(st.fixed_dictionaries({"type": st.sampled_from(["function", "web_search"]) | junk,
                                             "name": st.sampled_from(["f", "bad name"]) | junk}), max_size=2) | junk,
    "tool_choice": st.sampled_from(["auto", "none", "required"]) | junk, "truncation": junk,
    "text": st.fixed_dictionaries({"format": st.fixed_dictionaries({"type": st.just("json_schema"),
                                                                    "name": st.just("x"), "schema": schemas})})
    | junk,
    "metadata": st.dictionaries(anytext, anytext, max_size=3) | junk,
}
block = st.fixed_dictionaries({"type": st.sampled_from(["text", "tool_use", "tool_result", "thinking", "image"]) | junk},
                              optional={"text": text | junk, "id": text | junk, "name": text | junk,
                                        "input": junk, "tool_use_id": text | junk, "content": text | junk})
MESSAGES_FIELDS = {
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]) | junk,
                                                "content": text | st.lists(block, max_size=3) | junk}),
                         max_size=3) | junk,
    "system": text | st.lists(block, max_size=2) | junk, "stop_sequences": st.lists(text, max_size=3) | junk,
    "stream": st.booleans() | junk, "temperature": st.floats(-1, 3, allow_nan=False) | junk,
    "tools": st.lists(st.fixed_dictionaries({"name": st.sampled_from(["f", "bad name"]) | junk,
                                             "input_schema": schemas}), max_size=2) | junk,
    "tool_choice": st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "tool", "none"]) | junk},
                                         optional={"name": text | junk}) | junk,
    "output_config": st.fixed_dictionaries({"format": st.fixed_dictionaries({"type": st.just("json_schema"),
                                                                             "schema": schemas})}) | junk,
}


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


valid_responses = st.fixed_dictionaries(
    {"input": text.filter(str.strip) | st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "developer"]),
                                                                       "content": text}), min_size=1, max_size=2),
     "max_output_tokens": st.integers(1, 3)},
    optional={"instructions": text, "stream": st.booleans(), "store": st.booleans(), "temperature": st.floats(0, 2)})
valid_messages = st.fixed_dictionaries(
    {"messages": st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": text}), min_size=1, max_size=2),
     "max_tokens": st.integers(1, 3)},
    optional={"system": text, "stream": st.booleans(), "stop_sequences": st.lists(text.filter(bool), max_size=2),
              "temperature": st.floats(0, 1)})


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


def test_no_request_failed_after_fuzz(daemon):
    """No fuzzed request reached the middleware's catch-all (a 500 with a traceback in the log)."""
    lines = [json.loads(ln) for ln in daemon.log_path.read_text().splitlines() if ln.startswith("{")]
    failed = [ln for ln in lines if ln.get("event") == "request failed" or "exception" in ln]
    assert not failed, failed[:3]
    assert daemon.json("GET", "/health")[0] == 200
