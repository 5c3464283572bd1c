"""Anthropic's Messages API (/v1/messages) on the real daemon with the anthropic SDK as the client: system and content
blocks rendered as the chat route renders the same messages, stop_reason (end_turn, max_tokens, stop_sequence,
tool_use), streaming (the SDK's accumulator) equal to the non-streamed message, a tool call forced through
tool_choice on a synthetic model with a Qwen-style template and its tool_result sent back, reasoning as thinking
blocks, count_tokens, the API key as x-api-key or Bearer, and errors in Anthropic's shape."""
from __future__ import annotations

import http.client
import json

import pytest

from tests.daemon import Daemon, free_port

pytestmark = pytest.mark.slow
anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

KEY = "s3cret-key"
WEATHER = {"name": "get_weather", "description": "The weather in a city over the next days",
           "input_schema": {"type": "object", "properties": {
               "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima", "Kyoto"]},
               "days": {"type": "integer", "minimum": 1, "maximum": 7}},
               "required": ["city", "days"], "additionalProperties": False}}
CLOCK = {"name": "get_time", "description": "The time in a time zone",
         "input_schema": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 12}},
                          "required": ["tz"], "additionalProperties": False}}
ASK = [{"role": "user", "content": "What will the weather be in Paris for the next 3 days?"}]
GREEDY = {"temperature": 0}     # the anthropic SDK's create() has no sampling arguments; the API takes them


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    """The default model on TCP behind --api-key."""
    d = Daemon(tmp_path_factory.mktemp("messages"), "--api-key", KEY, port=free_port(), n_ctx=2048).start()
    yield d
    assert d.stop() == 0, d.log_tail()


def _client(daemon, key: str | None = KEY):
    return anthropic.Anthropic(base_url=f"http://127.0.0.1:{daemon.port}", api_key=key, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def client(smol):
    return _client(smol)


@pytest.fixture(scope="module")
def chat(smol):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{smol.port}/v1", api_key=KEY, max_retries=0, timeout=300)


def _blocks(message) -> list[dict]:
    """A message's content blocks without tool_use ids (which differ between two answers)."""
    return [{k: v for k, v in b.model_dump(exclude_none=True).items() if k != "id"} for b in message.content]


def _streamed(client, **kw):
    """(the SDK's final message, the text it streamed, the raw event types in order)."""
    kinds, text = [], []
    with client.messages.stream(**kw) as s:
        for ev in s:
            kinds.append(ev.type)
            if ev.type == "text":
                text.append(ev.text)
        final = s.get_final_message()
    return final, "".join(text), kinds


def test_text_as_the_chat_route_answers(client, chat):
    msgs = [{"role": "user", "content": "Name three primes."}]
    m = client.messages.create(model="default", max_tokens=24, messages=msgs, extra_body=GREEDY)
    c = chat.chat.completions.create(model="default", messages=msgs, max_tokens=24, temperature=0)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == c.choices[0].message.content
    assert m.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[c.choices[0].finish_reason]
    # input_tokens are those read, cache_read_input_tokens those the cache gave: together the prompt
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == c.usage.prompt_tokens
    assert m.usage.cache_read_input_tokens == m.model_extra["timings"]["cache_n"]
    assert m.usage.output_tokens == c.usage.completion_tokens
    assert m.model_extra["strata"]["resume_from"] in ("live", "checkpoint", "park", "none")


def test_system_blocks_history_and_count_tokens(client, chat):
    """system as a string or text blocks; user text blocks join; the prompt is the chat route's for the same
    messages; count_tokens counts it."""
    msgs = [{"role": "user", "content": [{"type": "text", "text": "Capital of "}, {"type": "text", "text": "France?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Paris."}]},
            {"role": "user", "content": "And of Italy?"}]
    kw = dict(model="default", max_tokens=10, extra_body=GREEDY)
    a = client.messages.create(system="Answer in one word.", messages=msgs, **kw)
    b = client.messages.create(system=[{"type": "text", "text": "Answer in "}, {"type": "text", "text": "one word."}],
                               messages=msgs, **kw)
    assert _blocks(a) == _blocks(b)
    flat = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Capital of France?"},
            {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And of Italy?"}]
    c = chat.chat.completions.create(model="default", messages=flat, max_tokens=10, temperature=0)
    assert b.usage.input_tokens + b.usage.cache_read_input_tokens == c.usage.prompt_tokens
    assert b.content[0].text == c.choices[0].message.content
    n = client.messages.count_tokens(model="default", system="Answer in one word.", messages=msgs)
    assert n.input_tokens == c.usage.prompt_tokens


def test_stream_equals_non_streamed_and_the_event_sequence(client):
    kw = dict(model="default", max_tokens=200, extra_body=GREEDY,
              messages=[{"role": "user", "content": "Write one sentence about the sea."}])
    m = client.messages.create(**kw)
    final, text, kinds = _streamed(client, **kw)
    assert _blocks(final) == _blocks(m) and text == m.content[0].text
    assert (final.stop_reason, final.stop_sequence) == (m.stop_reason, m.stop_sequence) == ("end_turn", None)
    assert final.usage.output_tokens == m.usage.output_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == \
        m.usage.input_tokens + m.usage.cache_read_input_tokens
    raw = [e.type for e in client.messages.create(stream=True, **kw)]
    assert raw[:2] == ["message_start", "content_block_start"] and raw[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert set(raw[2:-3]) == {"content_block_delta"}


def test_max_tokens_and_stop_sequences(client):
    kw = dict(model="default", extra_body=GREEDY,
              messages=[{"role": "user", "content": "Tell me a story about a dragon."}])
    cut = client.messages.create(max_tokens=8, **kw)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 8
    full = client.messages.create(max_tokens=40, **kw).content[0].text
    word = full.split()[3]                          # a word the greedy answer writes: stop there
    m = client.messages.create(max_tokens=40, stop_sequences=[word, "zzzq"], **kw)
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", word)
    assert m.content[0].text == full[:full.index(word)]
    final, _, _ = _streamed(client, max_tokens=40, stop_sequences=[word, "zzzq"], **kw)
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", word) and _blocks(final) == _blocks(m)


def test_output_config_format_holds_the_answer_to_a_schema(client):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "word": {"type": "string", "maxLength": 8}},
              "required": ["n", "word"], "additionalProperties": False}
    m = client.messages.create(model="default", max_tokens=60, messages=[{"role": "user", "content": "A number."}],
                               extra_body={"output_config": {"format": {"type": "json_schema", "schema": schema}},
                                           **GREEDY})
    assert m.stop_reason == "end_turn"
    jsonschema.validate(json.loads(m.content[0].text), schema)


def test_api_key_as_x_api_key_or_bearer(smol):
    def call(path, headers, body):
        c = http.client.HTTPConnection("127.0.0.1", smol.port, timeout=120)
        c.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json", **headers})
        r = c.getresponse()
        return r.status, json.loads(r.read())
    body = {"model": "default", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
    assert call("/v1/messages", {"x-api-key": KEY}, body)[0] == 200
    assert call("/v1/messages", {"Authorization": f"Bearer {KEY}"}, body)[0] == 200
    st, d = call("/v1/messages", {"x-api-key": "wrong"}, body)
    assert st == 401 and d == {"type": "error", "error": {"type": "authentication_error", "message": d["error"][
        "message"]}} and "x-api-key" in d["error"]["message"]
    st, d = call("/v1/chat/completions", {"x-api-key": KEY}, {"messages": body["messages"], "max_tokens": 2})
    assert st == 200 and d["object"] == "chat.completion"
    st, d = call("/v1/chat/completions", {}, {"messages": body["messages"]})
    assert st == 401 and d["error"]["type"] == "authentication_error"                  # OpenAI's shape there
    with pytest.raises(anthropic.AuthenticationError) as ei:
        _client(smol, "wrong").messages.create(model="default", max_tokens=2, messages=body["messages"])
    assert ei.value.body["error"]["type"] == "authentication_error"
    sdk = anthropic.Anthropic(base_url=f"http://127.0.0.1:{smol.port}", api_key=None, auth_token=None,
                              default_headers={"x-api-key": KEY}, max_retries=0, timeout=120)
    assert sdk.messages.create(model="default", max_tokens=2, messages=body["messages"]).stop_reason


def test_errors_in_anthropic_shape(client, smol):
    hi = [{"role": "user", "content": "Hi"}]
    with pytest.raises(anthropic.BadRequestError) as ei:
        client.messages.create(model="default", messages=hi, max_tokens=None)     # the SDK sends no max_tokens
    assert ei.value.body == {"type": "error", "error": {"type": "invalid_request_error",
                                                        "message": "'max_tokens' is required"}}
    r = client.messages.create(model="claude-nope", messages=hi, max_tokens=4)      # one model: any name is served
    assert r.content and r.model == "SmolLM2-135M-Instruct.Q4_1"
    bad = [
        ({"max_tokens": 0}, "'max_tokens' must be >= 1"),
        ({"max_tokens": 10 ** 9}, "max_tokens is 1000000000"),
        ({"messages": []}, "'messages' must be a non-empty array"),
        ({"messages": [{"role": "system", "content": "x"}]}, "'messages[0].role'"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
         "'messages[0].content[0].type' is 'image'"),
        ({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
         "'messages[0].content[0].tool_use_id'"),
        ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": 3}]}]},
         "'messages[0].content[0].input' must be an object"),
        ({"system": 5}, "'system' must be a string"),
        ({"stop_sequences": "x"}, "'stop_sequences' must be an array"),
        ({"stop_sequences": [""]}, "'stop_sequences' must not contain an empty string"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "'tools[0].type'"),
        ({"tools": [{"name": "bad name!", "input_schema": {}}]}, "'tools[0].name'"),
        ({"tools": [WEATHER], "tool_choice": {"type": "tool"}}, "'tool_choice.name'"),
        ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "not among the tools"),
        ({"tool_choice": {"type": "sometimes"}}, "'tool_choice'"),
        ({"temperature": 9}, "'temperature'"),
        ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "nope"}}}},
         "'output_config.format': invalid JSON schema"),
        ({"output_config": {"format": {"type": "xml"}}}, "'output_config.format' must be"),
    ]
    for extra, needle in bad:
        body = {"model": "default", "max_tokens": 4, "messages": hi, **extra}
        st, d = smol.json("POST", "/v1/messages", body)
        assert st == 400 and set(d) == {"type", "error"} and d["type"] == "error", (extra, d)
        assert d["error"]["type"] == "invalid_request_error" and needle in d["error"]["message"], (needle, d)
    st, d = smol.json("GET", "/v1/messages")
    assert st == 405 and d["type"] == "error" and d["error"]["type"] == "invalid_request_error"
    st, d = smol.json("POST", "/v1/messages", raw=b"{not json")
    assert st == 400 and d["error"]["type"] == "invalid_request_error"


# ---- tools on a synthetic model with a Qwen-style template, reasoning on one that thinks ---------------------------
# (`qwen` and `thinker`: tests/conftest.py's daemons on synthetic models with tests/templates.py's templates)
def _tool_uses(message) -> list:
    return [b for b in message.content if b.type == "tool_use"]


def test_forced_tool_use_and_its_result(qwen):
    """tool_choice {"type": "tool"} makes random weights call get_weather: a tool_use block whose input follows the
    schema, stop_reason tool_use, streamed the same (input_json_delta); the tool_result sent back is read from the
    cache onward."""
    client = _client(qwen, "unused")
    kw = dict(model="default", max_tokens=80, extra_body=GREEDY, tools=[WEATHER, CLOCK])
    named = {"type": "tool", "name": "get_weather"}
    m = client.messages.create(messages=ASK, tool_choice=named, **kw)
    uses = _tool_uses(m)
    assert m.stop_reason == "tool_use" and len(uses) == 1 and uses[0].name == "get_weather" and uses[0].id
    jsonschema.validate(uses[0].input, WEATHER["input_schema"])
    final, _, kinds = _streamed(client, messages=ASK, tool_choice=named, **kw)
    assert _blocks(final) == _blocks(m) and final.stop_reason == "tool_use"
    raw = list(client.messages.create(messages=ASK, tool_choice=named, stream=True, **kw))
    assert any(e.type == "content_block_delta" and e.delta.type == "input_json_delta" for e in raw)
    follow = ASK + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                                  "content": [{"type": "text", "text": '{"forecast": "sun"}'}]}]}]
    m2 = client.messages.create(messages=follow, tool_choice={"type": "auto", "disable_parallel_tool_use": True},
                                **kw)
    assert m2.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert m2.model_extra["strata"]["resume_from"] in ("live", "checkpoint")
    assert m2.usage.cache_read_input_tokens >= m.usage.input_tokens + m.usage.cache_read_input_tokens - 8
    any_ = client.messages.create(messages=ASK, tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                  **dict(kw, extra_body={"temperature": 1.0, "seed": 3}))
    assert any_.stop_reason == "tool_use" and len(_tool_uses(any_)) == 1
    name = _tool_uses(any_)[0].name
    jsonschema.validate(_tool_uses(any_)[0].input, {"get_weather": WEATHER, "get_time": CLOCK}[name]["input_schema"])


def test_reasoning_is_a_thinking_block(thinker):
    """The prompt opens a <think> block: an answer cut by max_tokens is one thinking block, streamed the same
    (thinking_delta); /v1/responses gives it as a reasoning item."""
    client = _client(thinker, "unused")
    kw = dict(model="default", messages=ASK, max_tokens=12, extra_body={"temperature": 1.0, "seed": 5})
    m = client.messages.create(**kw)
    assert [b.type for b in m.content] == ["thinking"] and m.content[0].thinking and m.stop_reason == "max_tokens"
    final, _, _ = _streamed(client, **kw)
    assert _blocks(final) == _blocks(m)
    r = openai.OpenAI(base_url=f"http://127.0.0.1:{thinker.port}/v1", api_key="unused", max_retries=0,
                      timeout=300).responses.create(model="default", input=ASK, max_output_tokens=12, temperature=1.0,
                                                    extra_body={"seed": 5})
    assert [i.type for i in r.output] == ["reasoning"] and r.status == "incomplete"
    assert r.output[0].content[0].text == m.content[0].thinking
    assert 0 < r.usage.output_tokens_details.reasoning_tokens <= 12


async def test_an_error_mid_stream_ends_it_with_an_error_event():
    """An ApiError after the stream began (a remote stage lost, say) ends it with Anthropic's error event."""
    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    from strata.serve.errors import ApiError
    from strata.serve.messages_api import _failed
    from strata.serve.sse import send_events

    async def handler(request):
        request["rid"] = "r1"

        async def events():
            yield "message_start", {"type": "message_start", "message": {}}
            raise ApiError(503, "the worker went away", code="worker_unavailable")
        return await send_events(request, None, events(), _failed)

    app = web.Application()
    app.router.add_post("/", handler)
    async with TestClient(TestServer(app)) as c:
        r = await c.post("/")
        text = await r.text()
    assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
    frames = [f.split("\n") for f in text.split("\n\n") if f]
    assert [f[0] for f in frames] == ["event: message_start", "event: error"]
    assert json.loads(frames[1][1][6:]) == {"type": "error", "error": {"type": "overloaded_error",
                                                                       "message": "the worker went away"}}


def test_a_final_assistant_message_is_continued(client, chat, hf_tokenizer):
    """Anthropic's prefill: a conversation that ends with an assistant message is rendered with that turn open (the
    prompt is transformers' apply_chat_template(..., continue_final_message=True) of the same messages, token for
    token) and the answer continues it (greedy: what a raw completion of that prompt text answers)."""
    hf = hf_tokenizer
    system = "You answer tersely."
    msgs = [{"role": "user", "content": "Name three fruits, separated by commas."},
            {"role": "assistant", "content": "Sure: apple, banana,"}]
    ref = hf.apply_chat_template([{"role": "system", "content": system}] + msgs, tokenize=False,
                                 continue_final_message=True)
    assert ref.endswith("Sure: apple, banana,") and ref.count("<|im_end|>") == 2
    n = client.messages.count_tokens(model="claude-sonnet-4-5", system=system, messages=msgs).input_tokens
    assert n == len(hf(ref, add_special_tokens=False)["input_ids"])
    got = client.messages.create(model="claude-sonnet-4-5", system=system, messages=msgs, max_tokens=8,
                                 extra_body=GREEDY)
    want = chat.completions.create(model="x", prompt=ref, max_tokens=8, temperature=0).choices[0].text
    assert got.content[0].text == want and want
    assert got.stop_reason in ("max_tokens", "end_turn")


@pytest.mark.parametrize("last,why", [
    ({"role": "assistant", "content": "Sure: "}, "final assistant content cannot end with trailing whitespace"),
    ({"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather",
                                        "input": {"city": "Paris", "days": 1}}]}, "only text can be continued"),
])
def test_a_final_assistant_message_that_cannot_be_continued_gets_400(client, last, why):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="x", messages=ASK + [last], max_tokens=4, tools=[WEATHER])
    assert why in str(e.value) and "messages[1].content" in str(e.value)


READ_FILE = {"name": "read_file", "description": "Read a file of the repository.",
             "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}


@pytest.mark.parametrize("max_tokens", [28, 34])
def test_cut_tool_use_input_is_what_its_stream_assembles(client, max_tokens):
    """A tool_use cut by max_tokens: the non-streamed message's input equals the one the SDK assembles from the
    streamed input_json_delta fragments (at 34 tokens the default model has written `{"path": "...", "`, which the
    SDK reads as {"path": ...}; the message said {} and an agent lost the argument)."""
    kw = dict(model="default", max_tokens=max_tokens, extra_body=GREEDY, tools=[READ_FILE],
              tool_choice={"type": "any"},
              messages=[{"role": "user", "content": "Read src/app/main.py and tell me what it does."}])
    m = client.messages.create(**kw)
    final, _, _ = _streamed(client, **kw)
    assert m.stop_reason == final.stop_reason == "max_tokens"
    assert _blocks(m) == _blocks(final)
    if max_tokens == 34:    # the fragments hold a complete key and value: the input carries them
        assert _tool_uses(m)[0].input["path"].endswith("src/app/main.py")


@pytest.mark.parametrize("args", ['{"x": NaN}', '{"x": -Infinity}', '{"x": 1e999}', '{"x": [1, 2e400', '{"x": NaN, "y"',
                                  "[" * 100000 + "]" * 100000, '{"x": ' + "[" * 5000, '{"x": 1} and then some',
                                  '{"x": 1}}'])
def test_tool_use_input_is_strict_json_whatever_the_arguments(args):
    """A tool call's arguments (whole, or cut by max_tokens) holding NaN, Infinity or a number past float's range,
    nested past the parser's depth, or an object followed by more text: the tool_use block's input is {} (as for
    arguments that do not parse), and the block is strict JSON (it was NaN / Infinity in the body, or a 500 from the
    RecursionError; the object alone, the text after it dropped unseen)."""
    import json as _json
    from strata.serve.answer_blocks import Block
    from strata.serve.messages_api import _block
    b = Block("call", 0, text=args, call_id="toolu_1", name="f")
    out = _block(b, True)
    assert out["input"] == {}
    _json.loads(_json.dumps(out, allow_nan=False))
