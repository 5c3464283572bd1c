"""OpenAI's Responses API (/v1/responses) on the real daemon with the openai SDK as the client: text in and out, input
items and instructions rendered as the chat route renders the same messages, streaming (the SDK's event accumulator)
equal to the non-streamed response, previous_response_id resuming from the engine's cache, the bounded store (store
false, eviction, GET and DELETE), function tools (a forced call out as a function_call item, its result in as a
function_call_output item) and errors in OpenAI's shape."""
from __future__ import annotations

import json

import pytest

from tests.daemon import Daemon, free_port

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

STORE = 3          # --responses-store: small, so that eviction is reached within the module
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city over the next days",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima", "Kyoto"]},
               "days": {"type": "integer", "minimum": 1, "maximum": 7}},
               "required": ["city", "days"], "additionalProperties": False}}
CLOCK = {"type": "function", "name": "get_time", "description": "The time in a time zone",
         "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 12}},
                        "required": ["tz"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    """The default model on TCP, keeping at most STORE responses."""
    d = Daemon(tmp_path_factory.mktemp("responses"), "--responses-store", str(STORE), port=free_port(),
               n_ctx=2048).start()
    yield d
    assert d.stop() == 0, d.log_tail()


@pytest.fixture(scope="module")
def client(smol):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{smol.port}/v1", api_key="unused", max_retries=0, timeout=300)


def _items(response) -> list[dict]:
    """A response's output items without their ids and call ids (which differ between two responses)."""
    return [{k: v for k, v in item.model_dump(exclude_none=True).items() if k not in ("id", "call_id")}
            for item in response.output]


def _streamed(client, **kw):
    """(the SDK's final response, the raw event types in order) of a streamed request, through responses.stream."""
    kinds = []
    with client.responses.stream(**kw) as s:
        for ev in s:
            kinds.append(ev.type)
        final = s.get_final_response()
    return final, kinds


def test_text_in_and_out_as_the_chat_route_answers(client):
    r = client.responses.create(model="default", input="Name three primes.", max_output_tokens=24, temperature=0)
    chat = client.chat.completions.create(model="default", messages=[{"role": "user", "content": "Name three primes."}],
                                          max_tokens=24, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_") and r.status in ("completed", "incomplete")
    assert r.output_text and r.output_text == chat.choices[0].message.content
    assert [i.type for i in r.output] == ["message"] and r.output[0].role == "assistant"
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.input_tokens_details.cached_tokens == r.model_extra["timings"]["cache_n"]
    assert r.model_extra["strata"]["resume_from"] in ("live", "checkpoint", "park", "none")
    assert r.max_output_tokens == 24 and r.temperature == 0


def test_streamed_equals_non_streamed_and_the_event_sequence(client):
    kw = dict(model="default", input=[{"role": "user", "content": "Write one sentence about the sea."}],
              max_output_tokens=200, temperature=0)
    r = client.responses.create(**kw)
    assert r.status == "completed", r.output_text
    final, kinds = _streamed(client, **kw)
    assert final.status == "completed" and final.output_text == r.output_text
    assert _items(final) == _items(r)
    assert final.usage.output_tokens == r.usage.output_tokens
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}


def test_stream_cut_by_max_output_tokens_ends_incomplete(client):
    kw = dict(model="default", input="Tell me a long story about a dragon.", max_output_tokens=6, temperature=0)
    r = client.responses.create(**kw)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete" and r.usage.output_tokens == 6
    events = list(client.responses.create(stream=True, **kw))
    seq = [e.sequence_number for e in events]
    assert seq == list(range(len(events)))
    last = events[-1]
    assert last.type == "response.incomplete" and last.response.status == "incomplete"
    assert last.response.output_text == r.output_text
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text


def test_input_items_and_instructions_render_as_chat_messages(client):
    """instructions are the system message; developer reads as system; input_text / output_text parts join; the
    prompt is the one the chat route renders for the same messages (same token count, same greedy answer)."""
    items = [{"role": "developer", "content": "Answer in one word."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Capital of "},
                                                              {"type": "input_text", "text": "France?"}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Paris."}]},
             {"role": "user", "content": "And of Italy?"}]
    r = client.responses.create(model="default", instructions="You are terse.", input=items, max_output_tokens=12,
                                temperature=0)
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "system", "content": "Answer in one word."},
            {"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "Paris."},
            {"role": "user", "content": "And of Italy?"}]
    chat = client.chat.completions.create(model="default", messages=msgs, max_tokens=12, temperature=0)
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.output_text == chat.choices[0].message.content
    assert r.instructions == "You are terse."


def test_previous_response_id_continues_from_the_cache(client):
    kw = dict(model="default", instructions="Be brief.", max_output_tokens=16, temperature=0)
    r1 = client.responses.create(input="Name a color.", **kw)
    r2 = client.responses.create(previous_response_id=r1.id, input="Name another one.", **kw)
    assert r2.previous_response_id == r1.id
    # the conversation is sent through the template again: the engine continues its live sequence (or a checkpoint)
    s = r2.model_extra["strata"]
    assert s["resume_from"] in ("live", "checkpoint")
    assert r2.usage.input_tokens_details.cached_tokens >= r1.usage.input_tokens - 8
    # the same prompt as the chat route's for the whole conversation (instructions are this request's, as OpenAI
    # does not carry them over)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."},
            {"role": "assistant", "content": r1.output_text}, {"role": "user", "content": "Name another one."}]
    chat = client.chat.completions.create(model="default", messages=msgs, max_tokens=16, temperature=0)
    assert r2.usage.input_tokens == chat.usage.prompt_tokens
    assert r2.output_text == chat.choices[0].message.content
    plain = client.responses.create(model="default", previous_response_id=r1.id, input="Name another one.",
                                    max_output_tokens=1, temperature=0)
    bare = client.chat.completions.create(model="default", messages=msgs[1:], max_tokens=1, temperature=0)
    assert plain.usage.input_tokens == bare.usage.prompt_tokens          # r1's instructions are not in it
    # and streamed, the chain continues the same way
    final, _ = _streamed(client, previous_response_id=r1.id, input="Name another one.", **kw)
    assert final.output_text == r2.output_text and final.usage.input_tokens == r2.usage.input_tokens


def _not_found(call) -> dict:
    with pytest.raises(openai.NotFoundError) as ei:
        call()
    body = ei.value.body
    assert set(body) == {"message", "type", "param", "code"} and body["type"] == "invalid_request_error"
    return body


def test_store_false_eviction_retrieve_and_delete(client, smol):
    kw = dict(model="default", max_output_tokens=2, temperature=0)
    gone = client.responses.create(input="One.", store=False, **kw)
    assert gone.store is False
    body = _not_found(lambda: client.responses.create(input="Two.", previous_response_id=gone.id, **kw))
    assert body["param"] == "previous_response_id" and body["code"] == "previous_response_not_found"
    kept = [client.responses.create(input=f"Say {i}.", **kw) for i in range(STORE + 1)]
    assert client.responses.retrieve(kept[1].id).output_text == kept[1].output_text     # read: now most recent
    extra = client.responses.create(input="Once more.", **kw)        # drops kept[2], the least recently used
    _not_found(lambda: client.responses.create(input="Next.", previous_response_id=kept[0].id, **kw))
    _not_found(lambda: client.responses.retrieve(kept[2].id))
    assert client.responses.retrieve(kept[1].id).id == kept[1].id
    client.responses.delete(extra.id)
    _not_found(lambda: client.responses.retrieve(extra.id))
    _not_found(lambda: client.responses.delete(extra.id))
    # over the socket too, the 404 is OpenAI's error object
    st, d = smol.json("POST", "/v1/responses", {"input": "x", "previous_response_id": "resp_nope"})
    assert st == 404 and d["error"]["code"] == "previous_response_not_found"
    # an id of 100,000 characters, or with escape sequences and bidirectional controls: quoted cut and escaped
    for rid in ["resp_" + "a" * 100000, "resp_\x1b[2J\u202e"]:
        st, d = smol.json("POST", "/v1/responses", {"input": "x", "previous_response_id": rid})
        msg = d["error"]["message"]
        assert st == 404 and len(msg) < 400 and msg.isprintable(), msg[:300]


def test_forced_function_call_and_its_output(client):
    """tool_choice names a function: the answer is a function_call item (arguments valid for its parameters),
    streamed the same; the call and its function_call_output sent back (by previous_response_id, and as items)
    give the next answer."""
    kw = dict(model="default", tools=[WEATHER, CLOCK], temperature=0, max_output_tokens=60)
    ask = "What will the weather be in Paris for the next 3 days?"
    r = client.responses.create(input=ask, tool_choice={"type": "function", "name": "get_weather"}, **kw)
    calls = [i for i in r.output if i.type == "function_call"]
    assert r.status == "completed" and len(calls) == 1 and calls[0].name == "get_weather"
    call = calls[0]
    assert call.call_id and call.id.startswith("fc_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    final, kinds = _streamed(client, input=ask, tool_choice={"type": "function", "name": "get_weather"}, **kw)
    assert _items(final) == _items(r)
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    result = {"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"forecast": "sun"})}
    r2 = client.responses.create(input=[result], previous_response_id=r.id, parallel_tool_calls=False, **kw)
    assert r2.status in ("completed", "incomplete") and r2.output
    assert {i.type for i in r2.output} <= {"message", "function_call"}
    assert r2.model_extra["strata"]["resume_from"] in ("live", "checkpoint")
    # stateless: the same conversation as items gives the same prompt
    items = [{"role": "user", "content": ask}, call.model_dump(exclude_none=True), result]
    r3 = client.responses.create(input=items, parallel_tool_calls=False, **kw)
    assert r3.usage.input_tokens == r2.usage.input_tokens and _items(r3) == _items(r2)


def test_errors_in_openai_shape(smol):
    bad = [
        ({}, 400, "'input' is required"),
        ({"input": 3}, 400, "'input' must be a string"),
        ({"input": []}, 400, "'input' must be a string"),
        ({"input": [{"role": "tool", "content": "x"}]}, 400, "'input[0].role'"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400,
         "'input[0].content[0]' has type 'input_image'"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, 400, "'input[0].type' is 'item_reference'"),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, 400, "'input[0].call_id'"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "'tools[0].type' is 'web_search'"),
        ({"input": "x", "tools": [{"type": "function", "name": "bad name!"}]}, 400, "'tools[0].name'"),
        ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, 400,
         "not among the tools"),
        ({"input": "x", "max_output_tokens": 0}, 400, "'max_output_tokens' must be >= 1"),
        ({"input": "x", "max_output_tokens": 10 ** 9}, 400, "max_output_tokens is 1000000000"),
        ({"input": "x", "temperature": 5}, 400, "'temperature'"),
        ({"input": "x", "truncation": "auto"}, 400, "'truncation' is 'auto'"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}}, 400,
         "'text.format': invalid JSON schema"),
        ({"input": "x", "previous_response_id": 7}, 400, "'previous_response_id' must be a string"),
        ({"input": "x", "previous_response_id": ""}, 400, "'previous_response_id' must be a response id"),
    ]
    for body, status, needle in bad:
        st, d = smol.json("POST", "/v1/responses", body)
        assert st == status and set(d) == {"error"}, (body, d)
        assert needle in d["error"]["message"], (needle, d)
        assert d["error"]["type"] == "invalid_request_error"
    st, d = smol.json("GET", "/v1/responses/resp_none")
    assert st == 404 and d["error"]["code"] == "not_found"
    st, d = smol.json("PUT", "/v1/responses")
    assert st == 405 and "error" in d


async def test_an_error_mid_stream_ends_it_with_error_and_response_failed():
    """An ApiError after the stream began ends it with an `error` event and `response.failed` (OpenAI's sequence)."""
    from types import SimpleNamespace

    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    from strata.serve import schema
    from strata.serve.errors import ApiError
    from strata.serve.responses_api import ResponsesRequest, ResponseStore, _Response
    from strata.serve.sse import send_events

    req = ResponsesRequest(schema.parse_chat({"messages": [{"role": "user", "content": "x"}]}), [], True)
    r = _Response(req, SimpleNamespace(model_name="m"), None, ResponseStore(1))

    async def handler(request):
        request["rid"] = "r1"

        async def events():
            yield r.event("response.created", response=r.obj("in_progress"))
            raise ApiError(400, "max_tokens is 9", param="max_tokens", code="invalid_value")
        return await send_events(request, None, events(), r.failed)

    app = web.Application()
    app.router.add_post("/", handler)
    async with TestClient(TestServer(app)) as c:
        text = await (await c.post("/")).text()
    frames = [f.split("\n") for f in text.split("\n\n") if f]
    assert [f[0][7:] for f in frames] == ["response.created", "error", "response.failed"]
    err, failed = json.loads(frames[1][1][6:]), json.loads(frames[2][1][6:])
    assert err == {"type": "error", "sequence_number": 1, "code": "invalid_value",
                   "message": "max_output_tokens is 9", "param": "max_output_tokens"}
    assert failed["response"]["status"] == "failed" and failed["sequence_number"] == 2
    assert failed["response"]["error"] == {"code": "invalid_value", "message": "max_output_tokens is 9"}


def test_store_is_lru_and_size_zero_keeps_nothing():
    from strata.serve.responses_api import ResponseStore
    s = ResponseStore(2)
    for k in "abc":
        s.put(k, {"id": k}, [])
    assert s.get("a") is None and len(s) == 2         # a, the least recently used, dropped for c
    assert s.get("b") is not None                      # b read: c is now the least recently used
    s.put("d", {"id": "d"}, [])
    assert s.get("c") is None and s.get("b") and s.get("d")
    assert s.delete("b") and not s.delete("b")
    none = ResponseStore(0)
    none.put("a", {}, [])
    assert none.get("a") is None and len(none) == 0


def test_store_holds_its_byte_budget_and_counts_a_shared_conversation_once():
    from strata.serve.responses_api import ResponseStore
    s = ResponseStore(100, budget=10_000)
    s.put("a", {"id": "a"}, [{"role": "user", "content": "x" * 2000}])
    one = s.nbytes
    a_turn = s.get("a")[1]
    s.put("b", {"id": "b"}, [{"role": "assistant", "content": "y"}], parent=a_turn)    # a chain: the user turn shared
    assert s.nbytes < 2 * one and len(s) == 2
    assert [m["content"] for m in s.get("b")[1].conversation()] == ["x" * 2000, "y"]
    assert s.delete("a") and s.get("b")[1].conversation()[0]["content"] == "x" * 2000   # b's turn keeps a's
    for k in "cdefgh":
        s.put(k, {"id": k}, [{"role": "user", "content": k * 2500}])
    assert s.nbytes <= 10_000 and s.get("b") is None and s.get("h") is not None
    for k in list("cdefgh"):
        s.delete(k)
    assert s.nbytes == 0 and len(s) == 0
    s.put("big", {"id": "big"}, [{"role": "user", "content": "z" * 20_000}])  # alone over the budget: not kept
    assert s.get("big") is None and s.nbytes == 0


def _answered(store, body: dict) -> dict:
    """body through parse and _Response.done as the route takes it, the engine's answer replaced by a fixed one."""
    from types import SimpleNamespace

    from strata.serve.responses_api import _Response, parse
    final = SimpleNamespace(finish_reason="stop", usage={"prompt_tokens": 1, "completion_tokens": 1,
                                                         "total_tokens": 2}, timings={}, strata={})
    ab = SimpleNamespace(final=final, blocks=[], reasoning_tokens=0, text=lambda: "ok")
    return _Response(parse(body, store), SimpleNamespace(model_name="m"), ab, store).done()


def test_store_bytes_count_what_a_long_chain_holds():
    """A chain continued one short message at a time after a long first input: the memory the store holds (traced
    by tracemalloc) stays within what it reports and its budget, each message is held once, and continuing a
    response whose parent the budget dropped still sends the whole conversation."""
    import gc
    import tracemalloc

    from strata.serve.responses_api import ResponseStore
    budget = 1 << 20
    tracemalloc.start()
    try:
        gc.collect()
        base = tracemalloc.get_traced_memory()[0]
        s = ResponseStore(10_000, budget=budget)
        first = [{"role": "user", "content": ""} for _ in range(2000)]
        rid = _answered(s, {"input": first})["id"]
        for i in range(150):
            rid = _answered(s, {"input": f"{i}", "previous_response_id": rid})["id"]
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert held <= 1.25 * s.nbytes and s.nbytes <= budget, (held, s.nbytes)
    history = s.get(rid)[1].conversation()
    assert len(history) == 2001 + 2 * 150 and [m["content"] for m in history[-3:]] == ["ok", "149", "ok"]
    # a budget that keeps only the last few responses: the last one still carries the whole conversation
    small = ResponseStore(10_000, budget=400_000)
    rid = _answered(small, {"input": [{"role": "user", "content": "q" * 50_000}]})["id"]
    for i in range(100):
        rid = _answered(small, {"input": "z" * 1000, "previous_response_id": rid})["id"]
    assert len(small) < 100 and small.nbytes <= 400_000
    history = small.get(rid)[1].conversation()
    assert history[0]["content"] == "q" * 50_000 and len(history) == 2 + 2 * 100


def test_metadata_is_held_to_openais_limits(smol):
    ok = {"input": "Hi", "max_output_tokens": 2, "metadata": {"k": "v" * 512}}
    st, d = smol.json("POST", "/v1/responses", ok)
    assert st == 200 and d["metadata"] == ok["metadata"]
    for md, needle in (({f"k{i}": "v" for i in range(17)}, "has 17 keys, at most 16"),
                       ({"k" * 65: "v"}, "a key of 65 characters"),
                       ({"k": "v" * 513}, "'metadata.k' has 513 characters"),
                       ({"k": [1, 2]}, "'metadata.k' must be a string"),
                       ({"k": "\ud800"}, "not valid Unicode"),
                       ({"\ud800": None}, "has a key that is not valid Unicode")):
        st, d = smol.json("POST", "/v1/responses", {**ok, "metadata": md})
        assert st == 400 and needle in d["error"]["message"], (md, d)
    st, s = smol.json("GET", "/status")
    assert s["responses_store"]["bytes"] > 0 and s["responses_store"]["budget"] == 256 << 20
