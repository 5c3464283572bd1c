"""The real daemon on the real default model, driven by real clients: openai over TCP, raw HTTP over the Unix socket."""
from __future__ import annotations

import asyncio
import gzip
import http.client
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import zlib

import pytest

from tests.daemon import Daemon, env_for_daemon, free_port
from tests.helpers import invalid_alone

pytestmark = pytest.mark.slow

API_KEY = "test-key-1234"
COUNT_PROMPT = "1, 2, 3, 4, 5, 6, 7, 8,"   # a greedy model keeps counting: a long generation on demand
HI = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    # one request slot: the queue tests below are the one-at-a-time engine's (request slots: test_parallel_serve)
    d = Daemon(tmp, "--api-key", API_KEY, "--queue-max", "1", "--max-body", "65536", "--alias", "smol,tiny",
               "--parallel", "1", port=free_port()).start()
    yield d
    rc = d.stop()
    assert rc == 0, d.log_tail()


@pytest.fixture(scope="module")
def client(daemon):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"http://127.0.0.1:{daemon.port}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model_id(daemon):
    st, d = daemon.json("GET", "/v1/models")
    assert st == 200
    return d["data"][0]["id"]


def sse_events(body: bytes) -> list:
    out = []
    for block in body.decode().split("\n\n"):
        if block.startswith("data: "):
            data = block[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


# ------------------------------------------------------------------------------------------ basics
def test_health_and_models_over_unix_socket(daemon, model_id):
    st, d = daemon.json("GET", "/health")
    assert st == 200 and d["status"] == "ok" and d["model"] == model_id
    assert model_id == "SmolLM2-135M-Instruct.Q4_1"
    st, d = daemon.json("GET", f"/v1/models/{model_id}")
    assert st == 200 and d["id"] == model_id and d["meta"]["n_ctx"] == 512
    st, d = daemon.json("GET", "/v1/models/gpt-4")
    assert st == 404 and d["error"]["code"] == "model_not_found"
    st, d = daemon.json("GET", "/v1/models")
    assert [m["id"] for m in d["data"]] == [model_id, "smol", "tiny"]
    st, d = daemon.json("GET", "/v1/models/tiny")
    assert st == 200 and d["id"] == "tiny" and d["meta"]["n_ctx"] == 512
    import os
    import stat
    assert stat.S_IMODE(os.stat(daemon.sock).st_mode) == 0o660


def test_openai_chat_usage_matches_reference_tokenizer(client, model_id, hf_tokenizer):
    r = client.chat.completions.create(model=model_id, messages=HI, max_tokens=8, temperature=0)
    ch = r.choices[0]
    assert ch.message.role == "assistant" and isinstance(ch.message.content, str) and ch.message.content
    assert ch.finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # the prompt length against an independent tokenizer + template: transformers reading the same GGUF
    tok = hf_tokenizer
    ref = tok.apply_chat_template(HI, add_generation_prompt=True, tokenize=True)
    ref = ref["input_ids"] if hasattr(ref, "keys") else ref
    assert r.usage.prompt_tokens == len(ref)


def test_raw_completion_reads_special_token_text_as_tokens(client, model_id, hf_tokenizer):
    """A /v1/completions prompt written in ChatML reads <|im_start|> / <|im_end|> as the special tokens (llama.cpp's
    server and vLLM do): the same token count as transformers' tokenizer on the same GGUF, and the same greedy answer
    as the chat endpoint gives for those messages."""
    msgs = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "What is 2+2?"}]
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in msgs) + "<|im_start|>assistant\n"
    raw = client.completions.create(model=model_id, prompt=text, max_tokens=8, temperature=0)
    chat = client.chat.completions.create(model=model_id, messages=msgs, max_tokens=8, temperature=0)
    assert raw.usage.prompt_tokens == chat.usage.prompt_tokens
    assert raw.choices[0].text == chat.choices[0].message.content
    tok = hf_tokenizer
    assert raw.usage.prompt_tokens == len(tok(text, add_special_tokens=False)["input_ids"])


def test_openai_client_with_any_model_name_is_served(client, model_id):
    r = client.chat.completions.create(model="gpt-4", messages=HI, max_tokens=4, temperature=0)
    assert r.choices[0].message.content and r.model == model_id


def test_openai_stream_equals_non_stream(client, model_id):
    kw = dict(model=model_id, messages=HI, max_tokens=12, temperature=0)
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_repeat_last_n_sets_the_penalties_history(client, model_id):
    """llama.cpp's repeat_last_n reaches the sampler on the OpenAI routes: with a history of 0 tokens a repeat
    penalty sees nothing (the plain greedy count), with the default 64 it changes the count; -2 is refused."""
    import openai
    kw = dict(model=model_id, prompt=COUNT_PROMPT, max_tokens=8, temperature=0)
    plain = client.completions.create(**kw).choices[0].text
    none = client.completions.create(**kw, extra_body={"repeat_penalty": 5.0, "repeat_last_n": 0}).choices[0].text
    last = client.completions.create(**kw, extra_body={"repeat_penalty": 5.0, "repeat_last_n": 64}).choices[0].text
    assert none == plain and last != plain, (plain, none, last)
    with pytest.raises(openai.BadRequestError, match="repeat_last_n"):
        client.completions.create(**kw, extra_body={"repeat_last_n": -2})


def test_stop_strings(client, model_id):
    base = client.completions.create(model=model_id, prompt=COUNT_PROMPT, max_tokens=12, temperature=0)
    text = base.choices[0].text
    assert " 11," in text, text          # the count goes on: 9, 10, 11, ...
    cut = text.index(" 11,")
    r = client.completions.create(model=model_id, prompt=COUNT_PROMPT, max_tokens=12, temperature=0, stop=[" 11,"])
    assert r.choices[0].text == text[:cut] and r.choices[0].finish_reason == "stop"
    s = list(client.completions.create(model=model_id, prompt=COUNT_PROMPT, max_tokens=12, temperature=0,
                                       stop=[" 11,", "zzz"], stream=True))
    assert "".join(c.choices[0].text for c in s if c.choices) == text[:cut]
    assert s[-1].choices[0].finish_reason == "stop"


def test_logprobs(client, model_id):
    r = client.chat.completions.create(model=model_id, messages=HI, max_tokens=5, temperature=0, logprobs=True,
                                       top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens - (r.choices[0].finish_reason == "stop")
    for e in content:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        lps = [t.logprob for t in e.top_logprobs]
        assert lps == sorted(lps, reverse=True) and sum(2.718281828 ** x for x in lps) <= 1 + 1e-6
        assert e.logprob == pytest.approx(lps[0], abs=1e-5)    # greedy picks the most likely token
        assert e.top_logprobs[0].token == e.token
    c = client.completions.create(model=model_id, prompt=COUNT_PROMPT, max_tokens=3, temperature=0, logprobs=2)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert "".join(lp.tokens) == c.choices[0].text


def test_logprobs_cover_exactly_the_text_when_a_stop_string_ends_it(client, model_id):
    """A stop string's tokens are cut from the answer and from its logprobs: the tokens join to the returned text,
    each text_offset is where its token starts in it, streamed and not; the chat content list likewise."""
    kw = dict(model=model_id, prompt=COUNT_PROMPT, max_tokens=12, temperature=0, logprobs=1, stop=[" 11"])
    r = client.completions.create(**kw)
    text, lp = r.choices[0].text, r.choices[0].logprobs
    assert r.choices[0].finish_reason == "stop" and text and not text.endswith(" 1")
    assert "".join(lp.tokens) == text
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]
    chunks = [c for c in client.completions.create(**kw, stream=True) if c.choices]
    toks = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    offs = [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert "".join(c.choices[0].text for c in chunks) == text and toks == lp.tokens and offs == lp.text_offset
    messages = [{"role": "user", "content": "Count from 1 to 20, separated by commas."}]
    ch = client.chat.completions.create(model=model_id, messages=messages, max_tokens=40, temperature=0,
                                        logprobs=True, stop=["7"])
    content = ch.choices[0].message.content
    assert ch.choices[0].finish_reason == "stop" and "7" not in content
    assert "".join(e.token for e in ch.choices[0].logprobs.content) == content


def test_logprobs_bytes_are_the_tokens_bytes(client, model_id):
    """A character spread over byte-fallback tokens: each entry's `bytes` are that token's own bytes (not the UTF-8
    of U+FFFD), so joining them rebuilds the text, as OpenAI, vLLM and llama.cpp give them."""
    r = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "Say 日本"}],
                                       max_tokens=6, temperature=0, logprobs=True, top_logprobs=1)
    content = r.choices[0].logprobs.content
    joined = b"".join(bytes(e.bytes) for e in content)
    assert joined.decode("utf-8", "ignore") == r.choices[0].message.content
    partial = [e for e in content if invalid_alone(bytes(e.bytes))]
    assert partial, "the greedy answer was expected to hold a character split over byte tokens"
    assert all(e.top_logprobs[0].bytes == e.bytes for e in content)


# ------------------------------------------------------------------------------------------ timings, strata, metrics
def test_timings_strata_and_checkpoint_metrics(daemon):
    body = {"messages": [{"role": "system", "content": "You are a terse assistant."},
                         {"role": "user", "content": "Name a colour."}], "max_tokens": 4, "temperature": 0,
            "cache_prompt": True, "strata_checkpoint": True, "strata_pin": 0}
    st, a = daemon.json("POST", "/v1/chat/completions", body)
    assert st == 200, a
    t = a["timings"]
    for k in ("prompt_n", "prompt_ms", "predicted_n", "predicted_ms", "cache_n"):
        assert k in t
    assert t["prompt_n"] + t["cache_n"] == a["usage"]["prompt_tokens"]
    assert t["predicted_n"] == a["usage"]["completion_tokens"]
    assert a["strata"]["resume_from"] in ("live", "checkpoint", "none")
    saved0 = daemon.metric("strata_checkpoint_tokens_saved_total")
    st, b = daemon.json("POST", "/v1/chat/completions", body)
    assert st == 200
    assert b["choices"][0]["message"]["content"] == a["choices"][0]["message"]["content"]
    assert b["timings"]["cache_n"] > 0 and b["strata"]["resume_from"] in ("live", "checkpoint")
    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == b["timings"]["cache_n"]
    assert b["strata"]["resume_pos"] == b["timings"]["cache_n"]
    assert daemon.metric("strata_checkpoint_tokens_saved_total") - saved0 == b["timings"]["cache_n"]
    st, off = daemon.json("POST", "/v1/chat/completions", dict(body, cache_prompt=False))
    assert st == 200 and off["timings"]["cache_n"] == 0
    assert off["choices"][0]["message"]["content"] == a["choices"][0]["message"]["content"]


def test_turn_phases_in_strata_metrics_and_log(daemon, client, model_id):
    """A generation's time to its first token, split into phases: in the strata block (streamed and not), adding up to
    the total with `other`, the model's forward calls among them; /metrics' histogram and phase counters and the
    request's log line carry the same report."""
    n0 = daemon.metric("strata_turn_outside_model_seconds_count")
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
    turns = []
    for stream in (True, False, True):
        if stream:
            extra = {}
            for chunk in client.chat.completions.create(model=model_id, messages=msgs, max_tokens=3, temperature=0,
                                                        stream=True):
                extra = chunk.model_extra.get("strata") or extra
            turn = extra["turn"]
        else:
            r = client.chat.completions.create(model=model_id, messages=msgs, max_tokens=3, temperature=0)
            turn = r.model_extra["strata"]["turn"]
        turns.append(turn)
        ph = turn["phases_ms"]
        assert set(ph) == {"parse", "render", "tokenize", "queue", "plan", "model", "slots", "checkpoint", "sample", "write"}
        assert all(v >= 0 for v in ph.values())
        assert ph["model"] > 0 and ph["render"] > 0 and ph["tokenize"] > 0 and ph["parse"] > 0
        assert abs(sum(ph.values()) + turn["other_ms"] - turn["ms"]) < 0.01      # rounding only
        assert abs(turn["outside_model_ms"] - (turn["ms"] - ph["model"] - ph["slots"])) < 0.01
        assert turn["other_ms"] > -0.01 and turn["ms"] >= ph["model"]
        msgs = msgs + [{"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another?"}]
    assert daemon.metric("strata_turn_outside_model_seconds_count") - n0 == 3
    assert daemon.metric("strata_turn_phase_seconds_total", {"phase": "model"}) > 0
    assert daemon.metric("strata_turn_phase_seconds_total", {"phase": "other"}) >= 0
    deadline = time.monotonic() + 10                 # the line is written once the response has ended
    while True:
        logged = [x for x in daemon.log_lines() if x.get("event") == "request" and "first_token_ms" in x]
        if len(logged) >= 3 and logged[-1]["first_token_ms"] == turns[-1]["ms"] or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert [x["first_token_ms"] for x in logged[-3:]] == [t["ms"] for t in turns]
    assert logged[-1]["phases_ms"] == turns[-1]["phases_ms"]


def test_metrics_label_a_wrong_method_with_its_route(daemon):
    """A 405 (a method the route does not take) counts under the route's template, not as "unmatched"; a path no
    route has stays "unmatched"."""
    st, _, _ = daemon.request("GET", "/slots/0")
    assert st == 405
    assert daemon.metric("strata_requests_total", {"route": "/slots/{slot}", "status": "405"}) >= 1
    st, _, _ = daemon.request("GET", "/slots/a%2Fb")   # matched by the router's (encoded) path: same label
    assert st == 405
    assert daemon.metric("strata_requests_total", {"route": "/slots/{slot}", "status": "405"}) >= 2
    st, _, _ = daemon.request("GET", "/v1/chat/completions")
    assert st == 405
    assert daemon.metric("strata_requests_total", {"route": "/v1/chat/completions", "status": "405"}) >= 1
    st, _, _ = daemon.request("GET", "/no/such/route")
    assert st == 404
    assert daemon.metric("strata_requests_total", {"route": "unmatched", "status": "404"}) >= 1


def test_metrics_series(daemon):
    st, h, b = daemon.request("GET", "/metrics")
    assert st == 200 and h["content-type"].startswith("text/plain")
    text = b.decode()
    for name in ("strata_requests_total", "strata_prompt_tokens_total", "strata_generated_tokens_total",
                 "strata_time_to_first_token_seconds_bucket", "strata_time_per_output_token_seconds_bucket",
                 "strata_queue_depth", "strata_checkpoint_hits_total", "strata_checkpoint_tokens_saved_total"):
        assert name in text, name
    assert daemon.metric("strata_time_to_first_token_seconds_count") >= 1
    assert daemon.metric("strata_generated_tokens_total") >= 1


def test_slots(daemon):
    st, d = daemon.json("GET", "/slots")
    assert st == 200 and d[0]["id"] == 0 and d[0]["n_ctx"] == 512
    for action in ("save", "restore"):
        st, e = daemon.json("POST", f"/slots/0?action={action}")
        assert st == 400 and "filename" in e["error"]["message"]
        st, e = daemon.json("POST", f"/slots/0?action={action}", {"filename": "a.bin", "id_slot": 0})
        assert st == 400 and "--slot-save-path" in e["error"]["message"]      # this daemon has no directory
    # erase: the conversation is forgotten (live sequence and checkpoints), the next request reads everything
    body = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
            "max_tokens": 2, "temperature": 0}
    daemon.json("POST", "/v1/chat/completions", body)
    before = daemon.json("GET", "/cache")[1]
    st, e = daemon.json("POST", "/slots/0?action=erase&action=save")      # which one? refused, nothing erased
    assert st == 400 and e["error"]["param"] == "action" and "2 times" in e["error"]["message"], e
    assert daemon.json("GET", "/cache")[1] == before
    st, d = daemon.json("POST", "/slots/0?action=erase", {"id_slot": 0, "filename": "x"})   # a body is ignored
    assert st == 200 and d["id_slot"] == 0 and d["n_erased"] > 0
    c = daemon.json("GET", "/cache")[1]
    # what stays is held by the conversations the daemon's earlier requests parked (they stay)
    assert [k for k in c["checkpoints"] if not k["pins"]] == [] and c["pos"] == 0
    st, a = daemon.json("POST", "/v1/chat/completions", body)
    assert st == 200 and a["timings"]["cache_n"] == 0 and a["strata"]["resume_from"] == "none"
    st, e = daemon.json("POST", "/slots/3?action=save")
    assert st == 404
    st, e = daemon.json("POST", "/slots/0?action=explode")
    assert st == 400 and e["error"]["param"] == "action"
    st, e = daemon.json("POST", "/slots/0")                 # no action: named as missing, not as "got None"
    assert st == 400 and e["error"]["param"] == "action" and "required" in e["error"]["message"]
    assert "None" not in e["error"]["message"]
    st, d = daemon.json("GET", "/status")
    assert st == 200 and d["engine"]["n_ctx"] == 512 and d["queue"]["max"] == 1
    st, d = daemon.json("GET", "/cache")
    assert st == 200 and isinstance(d["checkpoints"], list)


# ------------------------------------------------------------------------------------------ errors
@pytest.mark.parametrize("raw,needle", [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "must be a JSON object"),
    (b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', "not valid JSON"),
    (json.dumps({"messages": "hi"}).encode(), "'messages'"),
    (json.dumps({"messages": [{"role": "wizard", "content": "x"}]}).encode(), "role"),
    (json.dumps({"messages": HI, "temperature": "hot"}).encode(), "'temperature' must be a number"),
    (json.dumps({"messages": HI, "temperature": 7}).encode(), "'temperature' must be in"),
    (json.dumps({"messages": HI, "max_tokens": -1}).encode(), "'max_tokens'"),
    (json.dumps({"messages": HI, "n": 0}).encode(), "'n' must be in 1..16, got 0"),
    (json.dumps({"messages": HI, "n": 17}).encode(), "'n' must be in 1..16, got 17"),
    (json.dumps({"messages": HI, "top_logprobs": 3}).encode(), "needs 'logprobs'"),
    (json.dumps({"messages": HI, "stream_options": {"include_usage": True}}).encode(), "only allowed"),
    (json.dumps({"messages": HI, "strata_pin": 5}).encode(), "strata_pin"),
    (json.dumps({"messages": HI, "stop": ""}).encode(), "'stop'"),
    (json.dumps({"messages": HI, "stop": ["ok", "x" * 513]}).encode(), "513 characters, at most 512"),
    (json.dumps({"messages": HI, "tool_choice": "required"}).encode(), "needs 'tools'"),
    (json.dumps({"messages": HI, "tool_choice": {"type": "function", "function": {"name": "f"}}}).encode(),
     "needs 'tools'"),
    (json.dumps({"messages": HI, "tool_choice": "sometimes"}).encode(), "'tool_choice'"),
    (b'{"messages": [{"role": "user", "content": "hi \\ud800"}]}', "not valid Unicode"),
    (b'{"messages": [{"role": "system", "content": "\\ud83d"}, {"role": "user", "content": "x"}]}',
     "'messages[0].content' is not valid Unicode: lone surrogate U+D83D at code point 0"),
    # the first bad message is named, whichever kind it is (plain role-and-string messages are checked at once)
    (b'{"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b \\ud800"}, '
     b'{"role": "wizard", "content": "x"}]}', "'messages[1].content' is not valid Unicode: lone surrogate U+D800 at "
     "code point 2"),
    (b'{"messages": [{"role": "user", "content": "a", "name": "n"}, {"role": "user", "content": "\\udc80"}]}',
     "'messages[1].content' is not valid Unicode: lone surrogate U+DC80 at code point 0"),
    (b'{"messages": [{"role": "user", "content": "a"}, {"role": "wizard", "content": "\\udc80"}]}',
     "'messages[1].role' must be one of"),
    (b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "ok \\udc80"}]}]}',
     "'messages[0].content[0].text' is not valid Unicode: lone surrogate U+DC80 at code point 3"),
    (b'{"messages": ' + b"[" * 20000 + b"]" * 20000 + b"}", "not valid JSON: nested too deeply"),
])
def test_bad_requests_get_400(daemon, raw, needle):
    st, h, b = daemon.request("POST", "/v1/chat/completions", raw=raw)
    assert st == 400, b
    err = json.loads(b)["error"]
    assert needle in err["message"] and err["type"] == "invalid_request_error"


def test_body_that_does_not_decode_gets_400(daemon):
    """A body that is not what its Content-Encoding says: a 400 naming the encoding, not a 500, no error-level
    traceback logged, and the daemon answers the next request; a coding it does not know (br) is a 415 naming it."""
    n_before = len(daemon.log_lines())
    for enc in ("gzip", "deflate"):
        st, h, b = daemon.request("POST", "/v1/chat/completions", raw=b"not" + enc.encode(),
                                  headers={"Content-Encoding": enc})
        err = json.loads(b)["error"]
        assert st == 400 and err["type"] == "invalid_request_error", b
        assert f"could not be read (Content-Encoding {enc})" in err["message"] and "\n" not in err["message"]
        assert err["param"] == "Content-Encoding"
    st, h, b = daemon.request("POST", "/v1/chat/completions", raw=b"notbr", headers={"Content-Encoding": "br"})
    err = json.loads(b)["error"]
    assert st == 415 and "'br'" in err["message"] and err["code"] == "unsupported_content_encoding", b
    assert daemon.json("GET", "/health")[0] == 200
    lines = daemon.log_lines()[n_before:]
    assert not [ln for ln in lines if ln.get("level") in ("error", "critical") or "exception" in ln], lines


def test_body_that_does_not_decode_in_its_later_packets_is_answered_at_once(daemon):
    """A body of many packets that claims deflate and is not: answered when it has arrived, not left waiting for
    --body-timeout (aiohttp's own decoding failed on a later packet without telling the handler)."""
    body = b'{"a":' * 10_000 + b"1" + b"}" * 10_000       # 60 KB: under this daemon's --max-body
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(daemon.sock)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: strata\r\nContent-Type: application/json\r\n"
                  b"Content-Encoding: deflate\r\nContent-Length: %d\r\n\r\n" % len(body))
        for i in range(0, len(body), 16 << 10):
            s.sendall(body[i:i + (16 << 10)])
            time.sleep(0.005)
        r = http.client.HTTPResponse(s)
        r.begin()
        # read as raw deflate (its first byte is no zlib header) these bytes inflate to 380 KB: past --max-body
        assert r.status == 413 and "(Content-Encoding deflate)" in json.loads(r.read())["error"]["message"]


@pytest.mark.parametrize("later", [b"zz\r\nmpt\r\n", b"3\r\nmptXX\r\n"], ids=["chunk size", "chunk end"])
def test_chunked_framing_broken_in_a_later_packet_is_answered_at_once(daemon, later):
    """Chunked framing that breaks in a packet after the handler began reading the body: a 400 saying so (aiohttp's
    parser raised past the body and left the read waiting for --body-timeout), one answer, then the connection
    closes; the daemon answers the next request."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(daemon.sock)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: strata\r\nContent-Type: application/json\r\n"
                  b"Transfer-Encoding: chunked\r\n\r\n5\r\n{\"pro\r\n")
        time.sleep(0.3)                      # the handler is reading the body
        s.sendall(later)
        got = b""
        while chunk := s.recv(65536):
            got += chunk
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and got.count(b"HTTP/1.") == 1, got
    err = json.loads(body)["error"]
    assert err["message"].startswith("the request body could not be read: BadHttpMessage: ") and "b'" not in \
        err["message"], err
    assert daemon.json("GET", "/health")[0] == 200


def test_a_pipelined_requests_body_broken_while_it_waits_its_turn_is_answered_in_its_turn(daemon):
    """A pipelined request whose chunked body breaks while the request before it still runs: the first answered as
    always, the second a 400 saying its body could not be read, right after (its read waited for --body-timeout)."""
    a = json.dumps({"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "ignore_eos": True}).encode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(daemon.sock)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: strata\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(a), a) +
                  b"POST /v1/completions HTTP/1.1\r\nHost: strata\r\nContent-Type: application/json\r\n"
                  b"Transfer-Encoding: chunked\r\n\r\n5\r\n{\"pro\r\n")
        time.sleep(0.1)                      # the first request is still answering
        s.sendall(b"zz\r\nmpt\r\n")
        got = b""
        while chunk := s.recv(65536):        # the daemon closes after the second answer
            got += chunk
    answers = []
    while got:                               # each answer: its head, then Content-Length bytes of body
        head, _, got = got.partition(b"\r\n\r\n")
        n = int(re.search(rb"(?im)^content-length: *(\d+)", head).group(1))
        answers.append((int(head.split()[1]), json.loads(got[:n])))
        got = got[n:]
    assert len(answers) == 2, answers
    assert answers[0][0] == 200 and answers[0][1]["usage"]["completion_tokens"] == 24, answers[0]
    assert answers[1][0] == 400 and answers[1][1]["error"]["message"].startswith(
        "the request body could not be read: BadHttpMessage: "), answers[1]


def test_a_transfer_coding_other_than_chunked_is_400_naming_it(daemon):
    """Transfer-Encoding "gzip, chunked": the parser takes the chunks off and would hand the still-compressed bytes
    on as JSON; the answer names the transfer coding instead."""
    body = gzip.compress(json.dumps({"prompt": "Hello", "max_tokens": 1}).encode())
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(daemon.sock)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: strata\r\nContent-Type: application/json\r\n"
                  b"Transfer-Encoding: gzip, chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
        r = http.client.HTTPResponse(s)
        r.begin()
        err = json.loads(r.read())["error"]
    assert r.status == 400 and err["param"] == "Transfer-Encoding" and "'gzip'" in err["message"], err


@pytest.mark.parametrize("enc,pack", [("gzip", gzip.compress), ("deflate", zlib.compress),
                                      ("gzip, deflate", lambda b: zlib.compress(gzip.compress(b)))])
def test_compressed_body_is_decoded(daemon, enc, pack):
    raw = json.dumps({"prompt": "Hello", "max_tokens": 1, "temperature": 0}).encode()
    st, h, b = daemon.request("POST", "/v1/completions", raw=pack(raw), headers={"Content-Encoding": enc})
    assert st == 200 and json.loads(b)["usage"]["completion_tokens"] == 1, b


def test_compressed_body_past_max_body_when_decoded_gets_413(daemon):
    """A few kilobytes of gzip that inflate past --max-body (64 KiB here; 64 MiB sent) stop at it: 413, the daemon
    lives."""
    bomb = gzip.compress(b" " * (64 << 20))
    assert len(bomb) < 100_000
    st, h, b = daemon.request("POST", "/v1/completions", raw=bomb, headers={"Content-Encoding": "gzip"})
    err = json.loads(b)["error"]
    assert st == 413 and err["code"] == "request_too_large" and "--max-body" in err["message"], b
    assert daemon.json("GET", "/health")[0] == 200


def test_completion_prompt_with_a_lone_surrogate_gets_400(daemon):
    st, h, b = daemon.request("POST", "/v1/completions", raw=b'{"prompt": "hi \\udc80", "max_tokens": 1}')
    err = json.loads(b)["error"]
    assert st == 400 and "not valid Unicode" in err["message"] and err["param"] == "prompt"
    assert daemon.json("GET", "/health")[0] == 200


SUR = '"\\ud800"'        # JSON text of a lone surrogate
SCHEMA_SUR = '{"type": "string", "enum": [%s]}' % SUR


@pytest.mark.parametrize("route,body,param", [
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "response_format": '
     '{"type": "json_schema", "json_schema": {"name": "x", "schema": %s}}}' % SCHEMA_SUR,
     "'response_format.json_schema.schema.enum[0]' is not valid Unicode: lone surrogate U+D800"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "response_format": '
     '{"type": "json_object", "schema": {"type": "object", "properties": {%s: {"type": "string"}}}}}' % SUR,
     "'response_format.schema.properties' has a key that is not valid Unicode: lone surrogate U+D800"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "tools": [{"type": '
     '"function", "function": {"name": "f", "parameters": {"type": "object", "description": %s}}}]}' % SUR,
     "'tools[0].function.parameters.description' is not valid Unicode"),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 2, "json_schema": %s}' % SCHEMA_SUR,
     "'json_schema.enum[0]' is not valid Unicode: lone surrogate U+D800 at code point 0"),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 2, "grammar": "root ::= \\"a%s\\""}' % SUR[1:-1],
     "'grammar' is not valid Unicode: lone surrogate U+D800 at code point 11"),
    ("/v1/messages", '{"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], "output_config": '
     '{"format": {"type": "json_schema", "schema": %s}}}' % SCHEMA_SUR,
     "'output_config.format.schema.enum[0]' is not valid Unicode: lone surrogate U+D800"),
    ("/v1/responses", '{"input": "hi", "max_output_tokens": 2, "metadata": {"a": %s}}' % SUR,
     "'metadata.a' is not valid Unicode: lone surrogate U+D800"),
    ("/v1/responses", '{"input": "hi", "max_output_tokens": 2, "metadata": {%s: "a"}}' % SUR,
     "'metadata' has a key that is not valid Unicode: lone surrogate U+D800 at code point 0 of the key"),
    ("/v1/responses", '{"input": "hi", "max_output_tokens": 2, "text": {"format": {"type": "json_schema", "name": "x", '
     '"schema": %s}}}' % SCHEMA_SUR, "'text.format.schema.enum[0]' is not valid Unicode"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_lone_surrogates_in_schemas_and_echoed_fields_get_400(daemon, route, body, param, stream):
    """A lone surrogate in a JSON schema, a grammar, a tool or metadata has no UTF-8 encoding: a one-line 400 naming
    the field before anything runs (streamed or not), not a 500 or an empty stream."""
    raw = json.dumps(dict(json.loads(body), stream=stream)).encode()
    gen0 = daemon.metric("strata_generations_total")
    st, h, b = daemon.request("POST", route, raw=raw)
    assert st == 400, b
    d = json.loads(b)
    msg = d["error"]["message"]
    assert param in msg and "\n" not in msg, msg
    assert daemon.metric("strata_generations_total") == gen0          # refused before the engine ran


@pytest.mark.parametrize("sid,status,needle", [
    ("%C2%B2", 400, "slot id must be a non-negative integer, got '\u00b2'"),     # '²': str.isdigit() says yes
    ("%D9%A3", 400, "slot id must be a non-negative integer"),                  # Arabic-Indic three
    ("1" * 4301, 404, "slot 11111111111111111111... (4301 digits) does not exist"),   # past int()'s 4,300 digits
    ("0" * 5000, 200, None),                                                   # slot 0 with leading zeros
    ("x" * 100, 400, "xxx...' (100 characters)"),
])
def test_odd_slot_ids(daemon, sid, status, needle):
    st, h, b = daemon.request("POST", f"/slots/{sid}?action=erase")
    assert st == status, b
    if needle is not None:
        msg = json.loads(b)["error"]["message"]
        assert needle in msg and len(msg) < 200, msg


@pytest.mark.parametrize("header", [b"Authorization: Bearer \xff\xfe", b"Authorization: \xc3\x28",
                                    b"x-api-key: \xff" + API_KEY.encode(), b"x-api-key: " + API_KEY.encode() + b"\x80"])
def test_a_key_header_that_is_not_utf8_gets_401(daemon, header):
    """Key header bytes that are not UTF-8 are a wrong key: 401, with no traceback in the log."""
    with socket.create_connection(("127.0.0.1", daemon.port), timeout=30) as s:
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n" + header + b"\r\nConnection: close\r\n\r\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.split(b" ", 2)[1] == b"401", data[:300]
    assert json.loads(body)["error"]["code"] == "invalid_api_key"
    time.sleep(0.2)
    assert not [ln for ln in daemon.log_lines() if ln.get("event") == "request failed"]


def test_prompt_too_long_names_the_numbers(daemon):
    st, d = daemon.json("POST", "/v1/completions", {"prompt": "word " * 700, "max_tokens": 1})
    assert st == 400 and d["error"]["code"] == "context_length_exceeded"
    assert "512" in d["error"]["message"] and "tokens" in d["error"]["message"]
    assert daemon.json("GET", "/health")[0] == 200


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_huge_prompt_is_refused_before_tokenizing(daemon, path):
    """60 KB of text cannot fit in 512 tokens whatever the tokenizer does (no token covers more characters than its
    vocabulary string is long, 81 for SmolLM2): refused with that lower bound, without tokenizing (a multi-megabyte
    prompt under a larger --max-body would otherwise cost seconds of CPU first)."""
    text = "abcdefghij" * 6_000
    body = {"prompt": text} if path == "/v1/completions" else {"messages": [{"role": "user", "content": text}]}
    t0 = time.monotonic()
    st, d = daemon.json("POST", path, dict(body, max_tokens=1))
    assert st == 400 and d["error"]["code"] == "context_length_exceeded", d
    assert "at least" in d["error"]["message"] and "512" in d["error"]["message"]
    print(f"{path}: refused in {time.monotonic() - t0:.2f} s")
    assert daemon.json("GET", "/health")[0] == 200


def test_routes_models_and_sizes(daemon):
    st, d = daemon.json("GET", "/v1/nothing-here")
    assert st == 404 and "unknown route" in d["error"]["message"]
    for name in ("gpt-4o", "", "claude-3-5-sonnet", "SmolLM2-135M-Instruct.Q4_1.gguf"):   # one model: any name
        st, d = daemon.json("POST", "/v1/chat/completions", {"model": name, "messages": HI, "max_tokens": 1})
        assert st == 200 and d["model"] == "SmolLM2-135M-Instruct.Q4_1", (name, d)
    st, h, b = daemon.request("POST", "/v1/chat/completions",
                              raw=json.dumps({"messages": HI, "pad": "x" * 70000}).encode())
    assert st == 413 and "--max-body" in json.loads(b)["error"]["message"]
    st, d = daemon.json("GET", "/v1/chat/completions")
    assert st == 405 and "error" in d


def test_api_key_on_tcp(daemon):
    import http.client
    def call(headers):
        c = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=30)
        c.request("GET", "/v1/models", headers=headers)
        r = c.getresponse()
        return r.status, json.loads(r.read())
    assert call({})[0] == 401
    st, d = call({"Authorization": "Bearer wrong-key"})
    assert st == 401 and d["error"]["type"] == "authentication_error"
    assert call({"Authorization": f"Bearer {API_KEY}"})[0] == 200
    c = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=30)
    c.request("GET", "/health")
    assert c.getresponse().status == 200             # liveness probes need no key


def test_non_loopback_needs_api_key(tmp_path):
    import subprocess
    import sys
    from tests.daemon import ROOT, env_for_daemon
    r = subprocess.run([sys.executable, "-m", "strata.cli.main", "serve", "--socket", str(tmp_path / "s"),
                        "--host", "0.0.0.0", "--port", "1"], capture_output=True, text=True, env=env_for_daemon(),
                       cwd=ROOT, timeout=60)
    assert r.returncode == 2 and "--api-key" in r.stderr


@pytest.mark.parametrize("key", [" ", "two words", "tab\tkey"])
def test_api_key_with_spaces_is_refused(tmp_path, key):
    """A key with whitespace can never match 'Authorization: Bearer <key>' (HTTP trims and splits it): a usage
    error before anything starts, also through STRATA_API_KEY."""
    import subprocess
    import sys
    from tests.daemon import ROOT, env_for_daemon
    r = subprocess.run([sys.executable, "-m", "strata.cli.main", "serve", "--socket", str(tmp_path / "s"),
                        "--host", "0.0.0.0", "--port", "1"], capture_output=True, text=True,
                       env=env_for_daemon({"STRATA_API_KEY": key}), cwd=ROOT, timeout=60)
    assert r.returncode == 2 and "without spaces" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "s").exists()


# ------------------------------------------------------------------------------------------ concurrency
async def _stream_unix(sock: str, body: dict, on_first=None, stop_after: int | None = None):
    """Stream a completion over the Unix socket; -> (text, [arrival times of content events], events)."""
    import aiohttp
    conn = aiohttp.UnixConnector(path=sock)
    texts, times, events = [], [], []
    async with aiohttp.ClientSession(connector=conn) as s:
        async with s.post("http://strata/v1/completions", json=dict(body, stream=True)) as r:
            if r.status != 200:
                return r.status, await r.json(), r.headers
            async for line in r.content:
                line = line.strip()
                if not line.startswith(b"data: "):
                    continue
                if line == b"data: [DONE]":
                    events.append("[DONE]")
                    break
                ev = json.loads(line[6:])
                events.append(ev)
                t = ev["choices"][0]["text"] if ev["choices"] else ""
                if t:
                    texts.append(t)
                    times.append(time.monotonic())
                    if on_first is not None and len(texts) == 1:
                        on_first()
                    if stop_after is not None and len(texts) >= stop_after:
                        return "".join(texts), times, events   # leaving the block drops the connection
    return "".join(texts), times, events


def test_two_clients_take_turns(daemon):
    a = {"prompt": COUNT_PROMPT, "max_tokens": 10, "temperature": 0}
    b = {"prompt": "The quick brown fox", "max_tokens": 10, "temperature": 0}
    solo_a = asyncio.run(_stream_unix(daemon.sock, a))[0]
    solo_b = asyncio.run(_stream_unix(daemon.sock, b))[0]

    async def both():
        loop = asyncio.get_running_loop()
        started = asyncio.Event()
        ta = asyncio.create_task(_stream_unix(daemon.sock, a, on_first=lambda: loop.call_soon(started.set)))
        await asyncio.wait_for(started.wait(), 120)      # A is generating; B arrives while it runs
        tb = asyncio.create_task(_stream_unix(daemon.sock, b))
        return await asyncio.wait_for(ta, 120), await asyncio.wait_for(tb, 120)
    (text_a, times_a, _), (text_b, times_b, _) = asyncio.run(both())
    assert text_a == solo_a and text_b == solo_b           # neither sees the other's tokens
    assert times_b[0] >= times_a[-1]                       # the second waited for the first to finish


def test_queue_full_gives_503(daemon):
    long = {"prompt": COUNT_PROMPT, "max_tokens": 60, "temperature": 0}
    short = {"prompt": "Hello", "max_tokens": 2, "temperature": 0}

    async def run():
        import aiohttp
        first = asyncio.Event()
        loop = asyncio.get_running_loop()
        ta = asyncio.create_task(_stream_unix(daemon.sock, long, on_first=lambda: loop.call_soon(first.set)))
        done, _ = await asyncio.wait({ta, asyncio.ensure_future(first.wait())}, timeout=120,
                                     return_when=asyncio.FIRST_COMPLETED)
        assert first.is_set(), f"the long request did not start streaming: {ta.result() if ta.done() else 'timeout'}"
        # A is generating: 1 running, 0 waiting; with --queue-max 1 one of B, C waits and the other is refused

        async def post(body):
            async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=daemon.sock)) as s:
                async with s.post("http://strata/v1/completions", json=body) as r:
                    return r.status, await r.json(), dict(r.headers)
        b, c = await asyncio.wait_for(asyncio.gather(post(short), post(short)), 120)
        await asyncio.wait_for(ta, 120)
        return b, c
    b, c = asyncio.run(run())
    statuses = sorted([b[0], c[0]])
    assert statuses == [200, 503], (b, c)
    busy = b if b[0] == 503 else c
    assert busy[1]["error"]["code"] == "queue_full" and int(busy[2]["Retry-After"]) >= 1
    assert daemon.metric("strata_requests_total", {"status": "503"}) >= 1


def test_a_client_leaving_the_queue_frees_its_place(tmp_path):
    """A client that disconnects while its request waits gives its place back at once: /health's `waiting` drops,
    and a later request is queued rather than refused queue_full (jobs are matched by identity, not by comparing
    their token arrays)."""
    import aiohttp
    d = Daemon(tmp_path, "--queue-max", "2", "--parallel", "1", n_ctx=4096).start()
    short = {"prompt": "The quick brown fox jumps over", "max_tokens": 2, "temperature": 0}

    async def run():
        conn = aiohttp.UnixConnector(path=d.sock)
        async with aiohttp.ClientSession(connector=conn) as s:
            async def queue() -> dict:
                async with s.get("http://strata/health") as r:
                    return (await r.json())["queue"]

            async def until(pred, what):
                deadline = asyncio.get_running_loop().time() + 60
                while not pred(q := await queue()):
                    assert asyncio.get_running_loop().time() < deadline, f"{what}: /health says {q}"
                    await asyncio.sleep(0.05)

            async def post(body):
                async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=d.sock)) as c:
                    async with c.post("http://strata/v1/completions", json=body) as r:
                        return r.status, await r.json()

            long = asyncio.create_task(_stream_unix(d.sock, {"prompt": COUNT_PROMPT, "max_tokens": 3000,
                                                              "temperature": 0}))
            await until(lambda q: q["running"] == 1, "the long request did not start")
            b = asyncio.create_task(post(short))
            await until(lambda q: q["waiting"] == 1, "the first waiting request is not queued")
            c = asyncio.create_task(post(short))          # behind b: removing it compares it with b
            await until(lambda q: q["waiting"] == 2, "the second waiting request is not queued")
            c.cancel()                                     # the client goes away while queued
            await until(lambda q: q["waiting"] == 1 or long.done(), "the request whose client left stays queued")
            assert not long.done(), "the request whose client left held its place until the running one ended"
            e = asyncio.create_task(post(short))           # the freed place takes a new request
            await until(lambda q: q["waiting"] == 2 or e.done(), "the new request is neither queued nor answered")
            assert not e.done(), e.result()                # not refused queue_full: it waits behind b
            long.cancel()
            res_b, res_e = await asyncio.wait_for(asyncio.gather(b, e), 120)
            await until(lambda q: q["waiting"] == 0 and q["running"] == 0, "the queue did not empty")
            return res_b, res_e
    try:
        res_b, res_e = asyncio.run(run())
        assert res_b[0] == 200 and res_e[0] == 200, (res_b, res_e)
        assert res_b[1]["choices"][0]["text"] == res_e[1]["choices"][0]["text"]
        assert d.metric("strata_requests_total", {"route": "/v1/completions", "status": "503"}) == 0
    finally:
        assert d.stop() == 0, d.log_tail()


def test_disconnect_mid_stream_cancels_and_engine_stays_usable(daemon):
    probe = {"prompt": "The quick brown fox", "max_tokens": 6, "temperature": 0}
    before = asyncio.run(_stream_unix(daemon.sock, probe))[0]
    cancelled0 = daemon.metric("strata_generations_total", {"finish_reason": "cancelled"})
    gen0 = daemon.metric("strata_generated_tokens_total")
    text, _, _ = asyncio.run(_stream_unix(daemon.sock, {"prompt": COUNT_PROMPT, "max_tokens": 300, "temperature": 0},
                                          stop_after=2))
    assert text
    deadline = time.monotonic() + 60
    while daemon.metric("strata_generations_total", {"finish_reason": "cancelled"}) == cancelled0:
        assert time.monotonic() < deadline, "the engine did not stop after the client left"
        time.sleep(0.05)
    generated = daemon.metric("strata_generated_tokens_total") - gen0
    assert generated < 40, generated          # stopped soon after the disconnect, far from max_tokens=300
    assert asyncio.run(_stream_unix(daemon.sock, probe))[0] == before
    assert daemon.json("GET", "/health")[0] == 200


# ------------------------------------------------------------------------------------------ logging
def test_json_logs_carry_the_request_id(daemon):
    st, h, b = daemon.request("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2},
                              headers={"X-Request-Id": "req-abc-123"})
    assert st == 200 and h["x-request-id"] == "req-abc-123"
    assert json.loads(b)["id"] == "cmpl-req-abc-123"
    time.sleep(0.2)
    lines = daemon.log_lines()                       # every line is JSON (stderr is not a TTY)
    mine = [ln for ln in lines if ln.get("request_id") == "req-abc-123"]
    events = {ln["event"] for ln in mine}
    assert {"request", "generation finished"} <= events, events   # loop and engine-thread lines alike
    assert all("timestamp" in ln and "level" in ln for ln in lines)


def test_polled_routes_log_at_debug(daemon):
    """A supervisor's /health and a scraper's /metrics, answered, are not logged at info (one line a second would
    fill the journal); a refused one is, as is every other route."""
    for _ in range(3):
        assert daemon.request("GET", "/health")[0] == 200
    assert daemon.request("GET", "/metrics")[0] == 200
    assert daemon.request("GET", "/v1/models")[0] == 200
    assert daemon.request("POST", "/health")[0] == 405
    time.sleep(0.2)
    level = {}            # the test daemons log at debug: each (method, path)'s levels
    for ln in daemon.log_lines():
        if ln.get("event") == "request":
            level.setdefault((ln["method"], ln["path"], ln["status"] < 400), set()).add(ln["level"])
    assert level[("GET", "/v1/models", True)] == {"info"} and level[("POST", "/health", False)] == {"info"}
    assert level[("GET", "/health", True)] == {"debug"} and level[("GET", "/metrics", True)] == {"debug"}


def test_malformed_http_is_one_short_log_line_without_the_body(daemon):
    """A request whose chunked framing is broken: aiohttp answers 400 itself; the daemon's log gets one WARNING
    line naming the error, not an ERROR traceback quoting the body (a prompt would end up in the journal)."""
    marker = "SECRET-PROMPT-TEXT"
    body = json.dumps({"prompt": marker * 500, "max_tokens": 1}).encode()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(30)
        s.connect(daemon.sock)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: strata\r\nContent-Type: application/json\r\n"
                  b"Transfer-Encoding: chunked\r\n\r\n" + body)
        assert b" 400 " in s.recv(200).split(b"\r\n", 1)[0]   # aiohttp's own answer
    finally:
        s.close()
    time.sleep(0.3)
    text = daemon.log_path.read_text()
    assert marker not in text
    bad = [ln for ln in daemon.log_lines() if "malformed HTTP request" in ln.get("event", "")]
    assert bad and all(ln["level"] == "warning" and "exception" not in ln for ln in bad), bad
    assert daemon.json("GET", "/health")[0] == 200


# ------------------------------------------------------------------------------------------ shutdown
def test_sigterm_drains_and_notifies(tmp_path):
    ns_path = str(tmp_path / "notify.sock")
    ns = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    ns.bind(ns_path)
    ns.settimeout(0.2)
    got: list[str] = []

    def listen():
        while len(got) < 20:
            try:
                got.append(ns.recv(4096).decode())
            except socket.timeout:
                if stop_listen.is_set():
                    return
            except OSError:
                return
    stop_listen = threading.Event()
    th = threading.Thread(target=listen, daemon=True)
    th.start()
    d = Daemon(tmp_path, env={"NOTIFY_SOCKET": ns_path}).start()
    try:
        # The socket answers before the listener thread has necessarily read the READY datagram: wait for it.
        deadline = time.monotonic() + 10
        while not any("READY=1" in m for m in got) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert any("READY=1" in m for m in got), got
        order = [m for m in got if "STATUS=warming up" in m or "READY=1" in m]
        assert "STATUS=warming up" in order[0] and "READY=1" in order[-1], got   # the warm-up ran before READY
        st, s = d.json("GET", "/status")
        w = s["engine"]["warmup"]
        assert w["ms"] > 0 and w["reads"] and w["device_bytes"] is None        # the CPU: no device pools
        assert s["engine"]["pos"] == 0 and s["engine"]["checkpoints"] == [] and s["engine"]["parked"] == []
        result = {}

        def on_first():
            d.proc.send_signal(signal.SIGTERM)        # mid-generation
        result["r"] = asyncio.run(_stream_unix(d.sock, {"prompt": COUNT_PROMPT, "max_tokens": 20, "temperature": 0},
                                               on_first=on_first))
        text, _, events = result["r"]
        assert events[-1] == "[DONE]"                 # the running request finished its stream
        assert events[-2]["choices"][0]["finish_reason"] in ("length", "stop", "cancelled")
        rc = d.proc.wait(60)
        assert rc == 0, d.log_tail()
    finally:
        d.stop()
        stop_listen.set()
        th.join(5)
        ns.close()
    assert any("STOPPING=1" in m for m in got), got
    import os
    assert not os.path.exists(d.sock)


def test_second_sigterm_cancels_the_running_request(tmp_path):
    """SIGTERM drains (the running request may finish, up to --drain-timeout); a second SIGTERM stops it at once,
    as a second Ctrl-C does in llama.cpp's server and vLLM: the stream ends 'cancelled' long before its 300 tokens
    (the drain timeout, 120 s, is not what ended it), and the daemon exits 0."""
    d = Daemon(tmp_path, "--drain-timeout", "120").start()
    try:
        def on_first():
            d.proc.send_signal(signal.SIGTERM)
            threading.Timer(0.3, lambda: d.proc.send_signal(signal.SIGTERM)).start()
        text, _, events = asyncio.run(_stream_unix(d.sock, {"prompt": COUNT_PROMPT, "max_tokens": 300,
                                                            "temperature": 0}, on_first=on_first))
        assert events[-1] == "[DONE]"
        assert events[-2]["choices"][0]["finish_reason"] == "cancelled"
        n_content = sum(1 for e in events if isinstance(e, dict) and e["choices"][0].get("text"))
        assert n_content < 300
        assert d.proc.wait(60) == 0, d.log_tail()
        assert any(line.get("event") == "second signal: cancelling the running request" for line in d.log_lines())
    finally:
        d.stop()


def _cuda_unavailable():
    try:
        from strata.backend import cuda as C
    except Exception as e:  # noqa: BLE001
        return f"strata.backend.cuda not importable: {e}"
    return C.unavailable_reason()


@pytest.mark.skipif(_cuda_unavailable() is not None, reason=f"CUDA backend unavailable: {_cuda_unavailable()}")
def test_status_device_memory_on_cuda():
    """/status's "device" object for a CUDA engine: cudaMemGetInfo's numbers (read with CuPy directly here) and the
    KV pool allocated from CuPy's pool."""
    import cupy as cp

    from strata.engine import Engine
    e = Engine("default", n_ctx=512, device="cuda", prompt_cache=0)
    d = e.device_info()
    free, total = cp.cuda.runtime.memGetInfo()
    assert d["name"] == "cuda:0" and d["kind"] == "cuda" and "error" not in d
    assert d["device_total_bytes"] == total
    assert 0 < d["device_used_bytes"] <= total and abs(d["device_free_bytes"] - free) < total // 10
    assert d["pool_total_bytes"] >= d["pool_used_bytes"] >= d["kv_pool_bytes"] > 0
    assert d["weights_bytes"] == e.file.nbytes


def test_busy_tcp_port_is_a_clear_error_and_leaves_no_socket(tmp_path):
    """`strata serve --socket S --port P` with P taken: exit with one line naming the port; S is not left behind
    (a stale socket file would make the next start think another server is there)."""
    import subprocess
    import sys
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        sock = tmp_path / "s.sock"
        r = subprocess.run([sys.executable, "-m", "strata.cli.main", "serve", "--socket", str(sock), "--port",
                            str(port), "--n-ctx", "256"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert f"cannot listen on 127.0.0.1:{port}" in r.stderr and "Traceback" not in r.stderr
    assert not sock.exists()


def test_too_long_socket_path_is_a_clear_error(tmp_path):
    import subprocess
    import sys
    sock = tmp_path / ("d" * 120) / "strata.sock"
    r = subprocess.run([sys.executable, "-m", "strata.cli.main", "serve", "--socket", str(sock), "--n-ctx", "256"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "over the 107-byte limit of Unix socket addresses" in r.stderr
    assert not sock.parent.exists()          # nothing created


def test_unusable_socket_path_names_it(tmp_path):
    """A --socket whose directory cannot be made (under a regular file) or where no socket can be bound: one line
    naming the path and the reason, exit 1, no traceback."""
    import subprocess
    import sys
    from pathlib import Path

    from tests.daemon import ROOT, env_for_daemon
    (tmp_path / "file").write_text("x")
    for sock, needle in ((tmp_path / "file" / "s.sock", f"cannot create the socket directory {tmp_path / 'file'}"),
                         (Path("/proc/strata-test.sock"), "cannot listen on /proc/strata-test.sock")):
        r = subprocess.run([sys.executable, "-m", "strata.cli.main", "serve", "--socket", str(sock), "--n-ctx", "256"],
                           capture_output=True, text=True, timeout=120, env=env_for_daemon(), cwd=ROOT)
        assert r.returncode == 1 and "Traceback" not in r.stderr and needle in r.stderr, r.stderr


def test_serve_kv_q8_0_on_cpu_is_refused_before_listening(tmp_path):
    import subprocess
    import sys
    sock = tmp_path / "s.sock"
    r = subprocess.run([sys.executable, "-m", "strata.cli.main", "serve", "--socket", str(sock), "--kv", "q8_0"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--kv q8_0 needs --device cuda" in r.stderr and "Traceback" not in r.stderr
    assert not sock.exists()


def test_port_0_reports_the_bound_port(tmp_path):
    """`--port 0` lets the OS pick: the log's "listening" line and /status name the real port (not :0), and it
    answers there."""
    import http.client
    d = Daemon(tmp_path, port=0).start()
    try:
        st, s = d.json("GET", "/status")
        tcp = s["listen"]["tcp"]
        host, port = tcp.rsplit(":", 1)
        assert st == 200 and host == "127.0.0.1" and int(port) > 0
        assert any(line.get("event") == "listening" and line.get("tcp") == tcp for line in d.log_lines())
        c = http.client.HTTPConnection(host, int(port), timeout=10)
        c.request("GET", "/health")
        assert c.getresponse().status == 200
        c.close()
    finally:
        assert d.stop() == 0, d.log_tail()


def test_max_tokens_past_the_training_context_is_refused(daemon, client, model_id):
    """SmolLM2 was trained on 8192 tokens: more is a 400 naming max_tokens (not clamped); within it, an answer the
    configured context (512) cannot hold ends at the context with finish_reason "length"."""
    import openai
    for kw in ({"max_tokens": 8193}, {"max_completion_tokens": 100000}):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=model_id, messages=HI, **kw)
        err = e.value.body
        assert err["param"] == "max_tokens" and err["code"] == "invalid_value"
        assert "more than the model's training context of 8192 tokens" in err["message"]
    st, d = daemon.json("POST", "/v1/completions", {"prompt": COUNT_PROMPT, "max_tokens": 8192, "temperature": 0,
                                                     "cache_prompt": False})
    assert st == 200 and d["choices"][0]["finish_reason"] == "length"
    assert d["usage"]["total_tokens"] == 512


def test_a_request_without_max_tokens_ends_at_n_predict(tmp_path):
    d = Daemon(tmp_path, "--n-predict", "5").start()
    try:
        for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "Count to 50."}],
                                                     "temperature": 0}),
                           ("/v1/completions", {"prompt": "1, 2, 3, 4, 5, 6,", "temperature": 0})):
            st, r = d.json("POST", path, body)
            assert st == 200, r
            assert r["usage"]["completion_tokens"] == 5 and r["choices"][0]["finish_reason"] == "length", r
        st, r = d.json("POST", "/v1/completions", {"prompt": "1, 2, 3,", "max_tokens": 7, "temperature": 0})
        assert st == 200 and r["usage"]["completion_tokens"] == 7       # the request's own length wins
    finally:
        assert d.stop() == 0, d.log_tail()
    r = subprocess.run([sys.executable, "-m", "strata.cli.main", "serve", "--n-predict", "-2"], capture_output=True,
                       text=True, env=env_for_daemon(), timeout=120)
    assert r.returncode == 2 and "--n-predict" in r.stderr and "must be >= -1" in r.stderr


def test_an_integer_of_thousands_of_digits_is_named_plainly(daemon):
    st, d = daemon.json("POST", "/v1/chat/completions", raw=b'{"max_tokens": ' + b"9" * 5001 + b', "messages": []}')
    assert st == 400 and "more than 4300 digits" in d["error"]["message"] and "sys." not in d["error"]["message"]


@pytest.mark.parametrize("raw", [b"GET / HTTP/1.1\r\nHost: x\r\nX: a\x01b\r\n\r\n", b"G\x00T / HTTP/1.1\r\n\r\n",
                                 b"GET / HTTP/1.1\r\nBad Header: x\r\n\r\n", b"GET / HTTP/9.9\r\n\r\n",
                                 b"GET / HTTP/1.1\r\nContent-Length: x\r\n\r\n"])
def test_malformed_http_message_is_one_clean_line(raw):
    """aiohttp's parser errors (C and pure-Python parsers) come to "<type>: <what>": no "400, message:" prefix, no
    quoted bytes, no colon left dangling where the bytes were."""
    from aiohttp.http_parser import HttpRequestParser, HttpRequestParserPy
    from strata.serve.log import malformed
    loop = asyncio.new_event_loop()
    try:
        seen = 0
        for cls in (HttpRequestParser, HttpRequestParserPy):   # the pure-Python parser lets some of them through
            try:
                cls(object(), loop, 2 ** 16).feed_data(raw)
                continue
            except Exception as e:  # noqa: BLE001 -- whatever aiohttp raises is what malformed() reads
                why = malformed(e)
            seen += 1
            assert why and "\n" not in why and not why.endswith(":") and "message:" not in why, (cls, why)
            assert "\\x01" not in why and "b'" not in why
        assert seen
    finally:
        loop.close()


def test_malformed_http_answer_has_no_dangling_colon(daemon):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(30)
        s.connect(daemon.sock)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: strata\r\nX-Bad: a\x01b\r\n\r\n")
        data = b""
        while b"}}" not in data:
            chunk = s.recv(4096)
            if not chunk:
                break
            data += chunk
    finally:
        s.close()
    err = json.loads(data.split(b"\r\n\r\n", 1)[1])["error"]
    assert err["code"] == "bad_http" and err["message"] == "malformed HTTP request: BadHttpMessage: Invalid header " \
                                                          "value char", err


def test_embedding_routes_answer_501_naming_the_flag_without_embeddings(daemon):
    """A daemon started without --embeddings: every embedding route answers 501 in its API's error shape, naming the
    flag (llama-server's behaviour), before reading the body; the daemon goes on serving."""
    for path, body in (("/v1/embeddings", {"input": "hi", "model": "gpt-4"}), ("/embedding", {"content": "hi"}),
                       ("/embeddings", {"content": "hi"}), ("/api/embed", {"model": "m", "input": "hi"}),
                       ("/api/embeddings", {"model": "m", "prompt": "hi"}), ("/v1/embeddings", "not json")):
        st, r = daemon.json("POST", path, body)
        msg = r["error"] if isinstance(r["error"], str) else r["error"]["message"]
        assert st == 501 and "--embeddings" in msg and "\n" not in msg, (path, r)
        if path.startswith("/embedding"):
            assert r["error"]["type"] == "not_supported_error", r
    st, _ = daemon.json("GET", "/health")
    assert st == 200


def test_the_disk_tier_budget_and_bytes_in_status_and_metrics(tmp_path):
    """--conversation-cache-dir with --conversation-cache-disk-mib: /status reports the disk tier's files' bytes and
    its budget (engine.disk_stats), /metrics the same as strata_disk_tier_bytes / strata_disk_tier_budget_bytes: a
    parked conversation larger than the RAM budget (1 MiB) is kept on disk, its file's bytes counted."""
    disk = tmp_path / "disk"
    disk.mkdir()
    d = Daemon(tmp_path, "--conversation-cache-dir", str(disk), "--conversation-cache-disk-mib", "3",
               "--conversation-cache-mib", "1", "--park-resident", "0").start()
    try:
        st, s = d.json("GET", "/status")
        assert st == 200 and s["engine"]["disk_stats"]["budget_bytes"] == 3 << 20
        assert d.metric("strata_disk_tier_budget_bytes") == 3 << 20
        for text in ("Name a river.", "Name a mountain."):
            st, _ = d.json("POST", "/v1/chat/completions",
                           {"messages": [{"role": "user", "content": text}], "max_tokens": 2})
            assert st == 200
        st, s = d.json("GET", "/status")
        files = sum(f.stat().st_size for f in disk.glob("*.bin"))      # not the directory's lock file
        assert files > 0 and s["engine"]["disk_stats"]["bytes"] == files
        assert d.metric("strata_disk_tier_bytes") == files
    finally:
        assert d.stop() == 0, d.log_tail()
