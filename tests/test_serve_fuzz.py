"""Hypothesis fuzz of request bodies against the real daemon: every input gets well-formed JSON, /health survives."""
from __future__ import annotations

import json

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests.test_serve_daemon import Daemon  # noqa: E402

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

bodies = st.fixed_dictionaries(
    {"max_tokens": st.integers(-2, 3) | junk},                   # always present: generations stay short
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
@given(route=st.sampled_from(ROUTES), body=bodies)
def test_fuzz_json_bodies(daemon, route, body):
    st_, h, b = daemon.request("POST", route, raw=json.dumps(body).encode(), timeout=60)
    _check_answer(st_, h, b, bool(body.get("stream")))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(route=st.sampled_from(ROUTES + ["/slots/0?action=save", "/v1/models", "/nope"]),
       raw=st.binary(max_size=300) | st.text(max_size=200).map(str.encode))
def test_fuzz_raw_bytes(daemon, route, raw):
    st_, h, b = daemon.request("POST", route, raw=raw, timeout=60)
    assert st_ in (400, 404, 405, 413, 501), (st_, b[:200])
    assert json.loads(b)["error"]["message"]


def test_health_after_fuzz(daemon):
    st_, d = daemon.json("GET", "/health")
    assert st_ == 200 and d["status"] == "ok"
    assert daemon.proc.poll() is None
