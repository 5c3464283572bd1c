"""Hypothesis fuzz of request bodies against the real daemon: every input gets well-formed JSON, /health survives."""
from __future__ import annotations

import json

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests.daemon import Daemon  # noqa: E402

pytestmark = pytest.mark.slow

ROUTES = ["/v1/chat/completions", "/v1/completions"]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("fuzz"), "--queue-max", "4", "--max-body", "20000", n_ctx=256).start()
    yield d
    assert d.stop() == 0, d.log_tail()


junk = st.recursive(
    st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
    max_leaves=12)

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
    "tool_choice": st.sampled_from(["auto", "none", "required"]) | junk, "text": junk, "truncation": junk,
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
                                             "input_schema": junk}), max_size=2) | junk,
    "tool_choice": st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "tool", "none"]) | junk},
                                         optional={"name": text | junk}) | junk,
    "output_config": junk,
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
