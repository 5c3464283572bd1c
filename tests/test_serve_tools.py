"""Tools, reasoning and structured output through the real daemon with the openai SDK: a two-step agent loop (tool call,
tool result, answer) on a synthetic hybrid model with a Qwen-style template and on the default model (the generic
JSON format), forced through tool_choice so that random weights still call; the second step resumes from the cache;
streamed and non-streamed answers equal; json_schema answers of random-weight models checked with jsonschema."""
from __future__ import annotations

import json

import pytest

from tests.daemon import Daemon, free_port

pytestmark = pytest.mark.slow
jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city over the next days",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima", "Kyoto"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "days", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 12}},
                   "required": ["tz"], "additionalProperties": False}}}
TOOLS = [WEATHER, CLOCK]
ASK = [{"role": "user", "content": "What will the weather be in Paris for the next 3 days?"}]


def _client(daemon):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{daemon.port}/v1", api_key="unused", max_retries=0,
                         timeout=300)


# `qwen` and `thinker`: tests/conftest.py's daemons on synthetic models with tests/templates.py's templates
@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    """The default model (its template knows no tools: the generic JSON format), served on TCP."""
    tmp = tmp_path_factory.mktemp("smol")
    d = Daemon(tmp, port=free_port(), n_ctx=2048).start()
    yield d
    assert d.stop() == 0, d.log_tail()


def _calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in (message.tool_calls or [])]


def _assemble(chunks):
    """A streamed answer put together the way OpenAI's clients do: content, reasoning, calls by index."""
    content, reasoning, calls, finish = [], [], {}, None
    for ch in chunks:
        if not ch.choices:
            continue
        c = ch.choices[0]
        finish = c.finish_reason or finish
        d = c.delta
        content.append(d.content or "")
        reasoning.append((d.model_extra or {}).get("reasoning_content") or "")
        for tc in d.tool_calls or []:
            slot = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            if tc.id:
                assert slot["id"] is None, "a call's id comes once, with its name"
                slot["id"] = tc.id
            if tc.function and tc.function.name:
                assert not slot["arguments"], "the name comes before the arguments"
                slot["name"] += tc.function.name
            if tc.function and tc.function.arguments:
                slot["arguments"] += tc.function.arguments
    return "".join(content), "".join(reasoning), [calls[i] for i in sorted(calls)], finish


def _check_calls(calls, tools=TOOLS):
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for name, args in calls:
        jsonschema.validate(args, by_name[name])


def _agent_loop(client, model: str, extra: dict, live: bool):
    """Step 1: a call to get_weather forced by tool_choice; step 2: its result sent back, an answer. Each step also
    streamed, and the streamed answer equals the non-streamed one. live: step 2 continues step 1's sequence (its
    prompt and answer), which needs the answer re-rendered by the template to tokenize as it was generated."""
    kw = dict(model=model, temperature=0, extra_body=extra)
    named = {"type": "function", "function": {"name": "get_weather"}}
    r1 = client.chat.completions.create(messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=80, **kw)
    m1 = r1.choices[0].message
    assert r1.choices[0].finish_reason == "tool_calls"
    calls = _calls(m1)
    assert len(calls) == 1 and calls[0][0] == "get_weather"
    _check_calls(calls)
    assert m1.tool_calls[0].type == "function" and m1.tool_calls[0].id
    content, _, scalls, finish = _assemble(client.chat.completions.create(
        messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=80, stream=True, **kw))
    assert (content, [(c["name"], c["arguments"]) for c in scalls], finish) == (
        m1.content or "", [(c.function.name, c.function.arguments) for c in m1.tool_calls], "tool_calls")
    assert all(c["id"] for c in scalls)

    follow = ASK + [m1.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": m1.tool_calls[0].id,
                     "content": json.dumps({"forecast": ["sun", "rain", "sun"], "unit": calls[0][1]["unit"]})}]
    r2 = client.chat.completions.create(messages=follow, tools=TOOLS, parallel_tool_calls=False, max_tokens=100, **kw)
    # step 2 reads none of step 1's prompt again: it resumes at step 1's turn checkpoint (the start of its
    # generation prompt, which step 2 renders again as the head of the assistant message), or further on (live)
    turn1 = r1.model_extra["strata"]["parts"][-1][0]
    assert r1.usage.prompt_tokens - turn1 <= 8
    cache_n = r2.model_extra["timings"]["cache_n"]
    assert r2.model_extra["strata"]["resume_from"] in ("checkpoint", "live")
    assert cache_n >= turn1, (cache_n, turn1, r1.usage.prompt_tokens)
    if live:
        assert r2.model_extra["strata"]["resume_from"] == "live"
        assert cache_n >= r1.usage.prompt_tokens + r1.usage.completion_tokens - 1
    assert r2.usage.prompt_tokens_details.cached_tokens == cache_n
    m2 = r2.choices[0].message
    content, _, scalls, finish = _assemble(client.chat.completions.create(
        messages=follow, tools=TOOLS, parallel_tool_calls=False, max_tokens=100, stream=True, **kw))
    assert content == (m2.content or "") and finish == r2.choices[0].finish_reason
    assert [(c["name"], c["arguments"]) for c in scalls] == [(c.function.name, c.function.arguments)
                                                              for c in (m2.tool_calls or [])]
    if r2.choices[0].finish_reason == "tool_calls":
        _check_calls(_calls(m2))
    return r1, r2


def test_agent_loop_qwen_style(qwen):
    client = _client(qwen)
    # random weights under a grammar split the answer into tokens other than the template's re-rendering gives, so
    # step 2 resumes at step 1's turn checkpoint
    r1, r2 = _agent_loop(client, "default", {}, live=False)
    assert r2.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_agent_loop_default_model_generic_format(smol):
    client = _client(smol)
    r1, r2 = _agent_loop(client, "default", {}, live=True)     # a trained model writes the tokens the template would
    # the generic format's answer is JSON held to its shape: a response or calls, never loose text
    m2 = r2.choices[0].message
    assert m2.tool_calls or (m2.content is not None and r2.choices[0].finish_reason in ("stop", "length"))


@pytest.mark.parametrize("seed", range(4))
def test_required_tool_choice_calls_a_tool_whatever_the_weights(qwen, seed):
    """Random weights sampled at temperature 1: "required" still gives valid calls (one: parallel_tool_calls
    false)."""
    client = _client(qwen)
    r = client.chat.completions.create(model="default", messages=ASK, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, temperature=1.0, seed=seed, max_tokens=120)
    calls = _calls(r.choices[0].message)
    assert len(calls) == 1 and r.choices[0].finish_reason == "tool_calls"
    _check_calls(calls)


def _required_cut_leaves_no_content(client, lengths) -> None:
    """tool_choice "required" cut by max_tokens at each of `lengths`: no content and finish "length" or "tool_calls",
    whole and streamed alike, the same call names in both."""
    for n in lengths:
        kw = dict(model="default", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=n, temperature=0)
        r = client.chat.completions.create(**kw)
        m = r.choices[0].message
        assert not m.content and r.choices[0].finish_reason in ("length", "tool_calls"), (n, m)
        content, _, calls, finish = _assemble(client.chat.completions.create(**kw, stream=True))
        assert not content and finish == r.choices[0].finish_reason, (n, content)
        assert [c["name"] for c in calls] == [c.function.name for c in m.tool_calls or []], n


def test_required_calls_cut_by_max_tokens_leave_no_content(smol):
    """tool_choice "required" on the generic JSON format, cut off by max_tokens anywhere: no content, whole or
    streamed (a cut inside a second call's header came back as content: ', {"name": "get_'), the calls named so
    far and finish_reason "length"."""
    _required_cut_leaves_no_content(_client(smol), range(4, 48, 3))


def test_hermes_calls_cut_by_max_tokens_leave_no_content(qwen):
    """tool_choice "required" on the Hermes format (<tool_call> JSON), cut off by max_tokens at many lengths: no
    content, whole or streamed (a cut before the call's name came back as '<tool_call>\n{"na'), the calls named so
    far, the same names streamed."""
    _required_cut_leaves_no_content(_client(qwen), range(2, 30, 3))


def test_a_stop_string_inside_a_call_block_leaks_no_call_text(qwen):
    """A stop string that matches inside the Hermes call block (after '<tool', after '<tool_call>\n') ends the answer
    as max_tokens would: the block left unnamed is dropped, not content ('<tool' and '<tool_call>' came back as
    content with finish "stop"); a stop after the call keeps it. Whole and streamed alike."""
    client = _client(qwen)
    for stop, named in [("_call>", False), ('{"name', False), ("</tool_call>", True)]:
        kw = dict(model="default", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=40, temperature=0,
                  stop=[stop])
        r = client.chat.completions.create(**kw)
        m = r.choices[0].message
        assert not m.content and bool(m.tool_calls) == named, (stop, m)
        content, _, calls, finish = _assemble(client.chat.completions.create(**kw, stream=True))
        assert not content and finish == r.choices[0].finish_reason and bool(calls) == named, (stop, content)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_allowed_tools_limit_the_calls_to_the_named_tools(qwen, seed):
    """tool_choice allowed_tools (OpenAI's chat form, and the Responses API's flat form): in mode "required" random
    weights at temperature 1 still call, and only the allowed tool (get_time), never get_weather; a name not among
    the tools, a bad mode and an empty list are 400s naming the field."""
    client = _client(qwen)
    choice = {"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [
        {"type": "function", "function": {"name": "get_time"}}]}}
    r = client.chat.completions.create(model="default", messages=ASK, tools=TOOLS, temperature=1.0, seed=seed,
                                       max_tokens=120, extra_body={"tool_choice": choice})
    names = [c.function.name for c in r.choices[0].message.tool_calls or []]
    assert names and set(names) == {"get_time"}, r.choices[0].message
    r = client.responses.create(model="default", input=ASK[0]["content"], tools=[
        {"type": "function", **WEATHER["function"]}, {"type": "function", **CLOCK["function"]}], temperature=1.0,
        max_output_tokens=120, extra_body={"seed": seed, "tool_choice": {
            "type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "get_time"}]}})
    calls = [o.name for o in r.output if o.type == "function_call"]
    assert calls and set(calls) == {"get_time"}, r.output
    for spec, needle in (({"mode": "required", "tools": [{"type": "function", "function": {"name": "nope"}}]},
                          "tool_choice.allowed_tools.tools[0]' names the function 'nope'"),
                         ({"mode": "sometimes", "tools": []}, "tool_choice.allowed_tools.mode"),
                         ({"mode": "auto", "tools": []}, "tool_choice.allowed_tools.tools")):
        st, d = qwen.json("POST", "/v1/chat/completions", {"messages": ASK, "max_tokens": 4, "tools": TOOLS,
                                                           "tool_choice": {"type": "allowed_tools",
                                                                           "allowed_tools": spec}})
        assert st == 400 and needle in d["error"]["message"], (spec, d)


def test_responses_allowed_tools_errors_name_the_responses_fields(smol):
    """The Responses API's flat allowed_tools form: a bad mode, an empty or missing list, an item in the chat form
    and a name not among the tools are 400s naming the Responses API's own fields (tool_choice.mode,
    tool_choice.tools[j]) and the item shape it takes, not the chat form's (tool_choice.allowed_tools.*)."""
    tools = [{"type": "function", **WEATHER["function"]}, {"type": "function", **CLOCK["function"]}]
    get_time = {"type": "function", "name": "get_time"}
    cases = (({"mode": "sometimes", "tools": [get_time]}, "tool_choice.mode", "got \"sometimes\""),
             ({"tools": [get_time]}, "tool_choice.mode", "\"auto\" or \"required\""),
             ({"mode": "auto", "tools": []}, "tool_choice.tools", '{"type": "function", "name": ...}'),
             ({"mode": "auto"}, "tool_choice.tools", "non-empty array"),
             ({"mode": "auto", "tools": [{"type": "function", "function": {"name": "get_time"}}]},
              "tool_choice.tools[0]", '{"type": "function", "name": ...}'),
             ({"mode": "auto", "tools": [get_time, {"type": "function", "name": "nope"}]}, "tool_choice.tools[1]",
              "names the function 'nope', which is not among the tools (get_weather, get_time)"))
    for spec, field, words in cases:
        st, d = smol.json("POST", "/v1/responses", {"input": "hi", "max_output_tokens": 4, "tools": tools,
                                                    "tool_choice": {"type": "allowed_tools", **spec}})
        assert st == 400, (spec, d)
        msg = d["error"]["message"]
        assert msg.startswith(f"'{field}'") and words in msg and "allowed_tools." not in msg, (spec, d)
        assert d["error"].get("param") == field, (spec, d)


def test_advisory_fields_coding_agents_send_change_nothing(smol):
    """user, store, metadata, service_tier, modalities, prediction, verbosity and reasoning_effort (sent by the
    openai client as Codex, aider and OpenCode do): accepted, the greedy answer the same as without them."""
    client = _client(smol)
    kw = dict(model="default", messages=ASK, max_tokens=8, temperature=0)
    plain = client.chat.completions.create(**kw).choices[0].message.content
    r = client.chat.completions.create(**kw, user="u-1", store=False, metadata={"a": "b"}, service_tier="auto",
                                       modalities=["text"], reasoning_effort="low",
                                       extra_body={"prediction": {"type": "content", "content": "x"},
                                                   "verbosity": "low"})
    assert r.choices[0].message.content == plain


def test_tool_choice_none_and_bad_tool_requests(smol):
    client = _client(smol)
    r = client.chat.completions.create(model="default", messages=ASK, tools=TOOLS, tool_choice="none",
                                       max_tokens=8, temperature=0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")
    bad = [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among the tools"),
        ({"tool_choice": "required"}, "needs 'tools'"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
        # a name with a line break at its end ('$' matched before it: the name reached the template and the grammar)
        ({"tools": [{"type": "function", "function": {"name": "get_time\n"}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "x" * 100000}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "retrieval"}]}, "only 'function' tools"),
        ({"tools": [WEATHER, WEATHER]}, "names two tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
          "tool_choice": "required"}, "invalid JSON schema: Invalid type: nope"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
         "'response_format': invalid JSON schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": {
            "type": "string", "format": "no-such-format"}}}}, "Unknown format"),
        ({"response_format": {"type": "xml"}}, "not supported"),
        ({"chat_template_kwargs": {"messages": []}}, "may not set 'messages'"),
        ({"reasoning_format": "sometimes"}, "'reasoning_format'"),
        ({"messages": ASK + [{"role": "assistant", "tool_calls": [{"function": {"name": 3}}]}]},
         "messages[1].tool_calls[0].function.name"),
    ]
    for body, needle in bad:
        st, d = smol.json("POST", "/v1/chat/completions", {"messages": ASK, "max_tokens": 4, **body})
        assert st == 400, (body, d)
        assert needle in d["error"]["message"] and len(d["error"]["message"]) < 500, (needle, d)


def test_a_refusal_quotes_a_huge_value_cut(smol):
    """A 100,000-character role, block type or tool_choice name, on the chat, Messages and Responses routes: a 400
    naming the field whose message quotes the value's first characters (it was echoed whole: 100 KB of error)."""
    x = "x" * 100000
    for path, body, field in [
            ("/v1/chat/completions", {"max_tokens": 2, "messages": [{"role": x, "content": "t"}]}, "messages[0].role"),
            ("/v1/chat/completions", {"max_tokens": 2, "messages": ASK, "tools": TOOLS,
                                      "tool_choice": {"type": "function", "function": {"name": x}}}, "tool_choice"),
            ("/v1/messages", {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": [{"type": x}]}]},
             "messages[0].content[0].type"),
            ("/v1/responses", {"max_output_tokens": 16, "input": [{"role": x, "content": "t"}]}, "input[0].role")]:
        st, d = smol.json("POST", path, body)
        msg = d["error"]["message"]
        assert st == 400 and field in msg and "xxxx" in msg and len(msg) < 1200, (path, st, msg[:200], len(msg))


# Bounded answers (strings with maxLength or enums, arrays with maxItems, numbers with a range and a multipleOf, which
# bounds their digits), so that max_tokens (400) is above every answer's length.
SCHEMAS = [
    {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3}},
     "required": ["name", "age", "tags"], "additionalProperties": False},
    {"type": "object", "properties": {
        "point": {"type": "object", "properties": {"x": {"type": "number", "minimum": -5, "maximum": 5,
                                                         "multipleOf": 0.25},
                                                   "y": {"type": "number", "minimum": -5, "maximum": 5,
                                                         "multipleOf": 0.5}},
                  "required": ["x", "y"], "additionalProperties": False},
        "ok": {"type": "boolean"},
        "note": {"type": ["string", "null"], "maxLength": 8}},
     "required": ["point", "ok", "note"], "additionalProperties": False},
    {"type": "array", "items": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 99},
        "kind": {"enum": ["a", "b", 3, None]}}, "required": ["id", "kind"], "additionalProperties": False},
     "minItems": 1, "maxItems": 3},
    {"type": "object", "properties": {
        "level": {"enum": ["low", "mid", "high"]},
        "scores": {"type": "array", "items": {"type": "integer", "minimum": -9, "maximum": 9}, "minItems": 2,
                   "maxItems": 4},
        "meta": {"type": "object", "properties": {"v": {"const": 2}, "w": {"type": "string", "maxLength": 5}},
                 "required": ["v"], "additionalProperties": False}},
     "required": ["level", "scores", "meta"], "additionalProperties": False},
]


def _json_answers(daemon, seeds):
    client = _client(daemon)
    n = 0
    for schema in SCHEMAS:
        for seed in seeds:
            r = client.chat.completions.create(
                model="default", messages=[{"role": "user", "content": "Answer in JSON."}], temperature=1.0,
                seed=seed, max_tokens=400, response_format={"type": "json_schema", "json_schema": {
                    "name": "answer", "schema": schema, "strict": True}})
            assert r.choices[0].finish_reason == "stop", (schema, seed, r.choices[0].message.content)
            jsonschema.validate(json.loads(r.choices[0].message.content), schema)
            n += 1
    return n


def test_json_schema_answers_of_random_weights_validate(qwen):
    assert _json_answers(qwen, range(6)) == 6 * len(SCHEMAS)


def test_json_schema_answers_of_the_default_model_validate(smol):
    assert _json_answers(smol, range(2)) == 2 * len(SCHEMAS)


def test_json_object_and_completion_fields(smol):
    client = _client(smol)
    r = client.chat.completions.create(model="default", messages=[{"role": "user", "content": "A JSON object."}],
                                       response_format={"type": "json_object"}, max_tokens=200, temperature=0)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    c = client.completions.create(model="default", prompt="A number as JSON:", max_tokens=40, temperature=0,
                                  extra_body={"json_schema": schema})
    jsonschema.validate(json.loads(c.choices[0].text), schema)
    c = client.completions.create(model="default", prompt="Yes or no?", max_tokens=10, temperature=0,
                                  extra_body={"grammar": 'root ::= "yes" | "no"'})
    assert c.choices[0].text in ("yes", "no") and c.choices[0].finish_reason == "stop"
    for body, needle in (({"grammar": "root ::= nothing"}, "'grammar': invalid grammar"),
                         ({"json_schema": {"type": "nope"}}, "'json_schema': invalid JSON schema"),
                         ({"json_schema": {}, "grammar": "root ::= \"a\""}, "send one")):
        st, d = smol.json("POST", "/v1/completions", {"prompt": "x", "max_tokens": 4, **body})
        assert st == 400 and needle in d["error"]["message"], d


def test_chat_takes_llama_servers_grammar_and_json_schema(smol):
    """llama-server's `grammar` and `json_schema` hold a chat answer too (they were ignored there): the answers keep
    to them, streamed alike; an empty grammar is none; a grammar beside tools, or either beside response_format, is a
    400 naming the field."""
    client = _client(smol)
    ask = [{"role": "user", "content": "Say yes."}]
    r = client.chat.completions.create(model="default", messages=ask, max_tokens=10, temperature=0,
                                       extra_body={"grammar": 'root ::= "no" | "maybe"'})
    assert r.choices[0].message.content in ("no", "maybe") and r.choices[0].finish_reason == "stop"
    chunks = client.chat.completions.create(model="default", messages=ask, max_tokens=10, temperature=0,
                                            stream=True, extra_body={"grammar": 'root ::= "no" | "maybe"'})
    assert _assemble(chunks)[0] == r.choices[0].message.content
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    r = client.chat.completions.create(model="default", messages=ask, max_tokens=40, temperature=0,
                                       extra_body={"json_schema": schema})
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    plain = client.chat.completions.create(model="default", messages=ask, max_tokens=8, temperature=0)
    empty = client.chat.completions.create(model="default", messages=ask, max_tokens=8, temperature=0,
                                           extra_body={"grammar": ""})
    assert empty.choices[0].message.content == plain.choices[0].message.content
    for body, param in (({"grammar": 'root ::= "a"', "tools": TOOLS}, "grammar"),
                        ({"json_schema": schema, "response_format": {"type": "json_object"}}, "json_schema"),
                        ({"grammar": 'root ::= "a"', "response_format": {"type": "json_object"}}, "grammar"),
                        ({"grammar": "root ::= nothing"}, "grammar")):
        st, d = smol.json("POST", "/v1/chat/completions", {"messages": ask, "max_tokens": 4, **body})
        assert st == 400 and d["error"]["param"] == param and f"'{param}'" in d["error"]["message"], (body, d)


def test_reasoning_content_and_template_kwargs(thinker):
    """The prompt opens a reasoning block: a random-weight answer cut by max_tokens is all reasoning_content, streamed
    the same; enable_thinking=false (chat_template_kwargs) closes the block in the prompt and the answer is content;
    reasoning_format "none" leaves the reasoning in content."""
    client = _client(thinker)
    kw = dict(model="default", messages=ASK, max_tokens=12, temperature=1.0, seed=5)
    r = client.chat.completions.create(**kw)
    m = r.choices[0].message
    reasoning = m.model_extra.get("reasoning_content")
    assert r.choices[0].finish_reason == "length" and reasoning and m.content == ""
    content, s_reasoning, calls, finish = _assemble(client.chat.completions.create(stream=True, **kw))
    assert (content, s_reasoning, calls, finish) == ("", reasoning, [], "length")
    raw = client.chat.completions.create(extra_body={"reasoning_format": "none"}, **kw).choices[0].message
    assert raw.content.strip() == reasoning and not raw.model_extra.get("reasoning_content")
    off = client.chat.completions.create(extra_body={"chat_template_kwargs": {"enable_thinking": False}}, **kw)
    assert off.usage.prompt_tokens > r.usage.prompt_tokens                        # the closed block is in the prompt
    assert off.choices[0].message.content and not off.choices[0].message.model_extra.get("reasoning_content")


def test_history_with_calls_renders_without_tools(qwen):
    """An assistant turn with tool_calls (arguments a JSON string) and its result are rendered by the template even
    when the request carries no tools (the last turn of an agent loop)."""
    client = _client(qwen)
    msgs = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                           "arguments": '{"city": "Paris", "days": 3, "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = client.chat.completions.create(model="default", messages=msgs, max_tokens=4, temperature=0)
    assert r.choices[0].message.tool_calls is None
    with_tools = client.chat.completions.create(model="default", messages=msgs, tools=TOOLS, tool_choice="none",
                                                max_tokens=4, temperature=0)
    assert with_tools.usage.prompt_tokens == r.usage.prompt_tokens            # tool_choice none: no tools rendered
