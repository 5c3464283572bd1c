"""Tool-call parsing per template family on recorded answers (written by hand from each family's documented format),
malformed calls as text, streamed parsing equal to whole parsing however the text is cut, reasoning split, family
detection and the messages each template gets back."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st

from strata.structured import reasoning, tool_calls as tc

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                      "parameters": {"type": "object", "properties": {
                                          "location": {"type": "string"}, "unit": {"type": "string"},
                                          "days": {"type": "integer"}}, "required": ["location"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"type": "string"}, "opts": {"type": "object"}}}}},
]


def calls_of(result):
    """(content without the whitespace around it, as answers give it, [(name, arguments)])."""
    content, calls = result
    return content.strip(), [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


# Recorded answers: (family, text, expected content, expected [(name, arguments)]).
RECORDED = [
    # Qwen2.5 / Qwen3 / Qwen3-Next / Hermes 2 Pro (Qwen's function-calling guide: one <tool_call> block per call)
    (tc.Hermes(), '<tool_call>\n{"name": "get_weather", "arguments": {"location": "San Francisco, CA, USA"}}\n'
                  '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "America/Los_Angeles"}}\n'
                  '</tool_call>',
     "", [("get_weather", {"location": "San Francisco, CA, USA"}), ("get_time", {"tz": "America/Los_Angeles"})]),
    (tc.Hermes(), "I'll check the weather first.\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
                  "{\"location\": \"Paris\", \"unit\": \"celsius\"}}\n</tool_call>",
     "I'll check the weather first.", [("get_weather", {"location": "Paris", "unit": "celsius"})]),
    (tc.Hermes(), '<tool_call>\n{"arguments": {"tz": "UTC"}, "name": "get_time"}\n</tool_call>',     # other key order
     "", [("get_time", {"tz": "UTC"})]),
    (tc.Hermes(), '<tool_call>\n{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}\n</tool_call>',  # string args
     "", [("get_time", {"tz": "UTC"})]),
    (tc.Hermes(), '<tool_call>\n{"name": "get_time", "arguments": {"opts": {"a": [1, {"b": "}"}]}}}\n</tool_call>',
     "", [("get_time", {"opts": {"a": [1, {"b": "}"}]}})]),
    (tc.Hermes(), "No tools needed: 2 + 2 = 4.", "No tools needed: 2 + 2 = 4.", []),
    # Qwen3-Coder / Qwen3.5 XML (values are text; typed by the tool's parameter schema)
    (tc.QwenXml(), "<tool_call>\n<function=get_weather>\n<parameter=location>\nSan Francisco, CA\n</parameter>\n"
                   "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
     "", [("get_weather", {"location": "San Francisco, CA", "days": 3})]),
    (tc.QwenXml(), "Let me look.\n<tool_call>\n<function=get_time>\n<parameter=opts>\n{\"dst\": true}\n</parameter>\n"
                   "</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=location>\nOslo\n"
                   "</parameter>\n</function>\n</tool_call>",
     "Let me look.", [("get_time", {"opts": {"dst": True}}), ("get_weather", {"location": "Oslo"})]),
    (tc.QwenXml(), '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', "", [("get_time", {})]),
    # Llama 3.1-3.3 JSON-based tool calling (Meta's prompt-format docs), with and without <|python_tag|>
    (tc.Llama3(), '{"name": "get_weather", "parameters": {"location": "San Francisco, CA", "unit": "fahrenheit"}}',
     "", [("get_weather", {"location": "San Francisco, CA", "unit": "fahrenheit"})]),
    (tc.Llama3(), '<|python_tag|>{"name": "get_time", "parameters": {"tz": "UTC"}}; '
                  '{"name": "get_weather", "parameters": {"location": "Rome"}}',
     "", [("get_time", {"tz": "UTC"}), ("get_weather", {"location": "Rome"})]),
    (tc.Llama3(), '{"type": "function", "name": "get_time", "parameters": {}}', "", [("get_time", {})]),
    (tc.Llama3(), "The JSON format looks like {\"name\": \"x\"}.", "The JSON format looks like {\"name\": \"x\"}.",
     []),
    # Mistral: v3 tokenizers (Mistral 7B v0.3, Nemo) and the v11+ [ARGS] form (Mistral Small 3.2, Devstral)
    (tc.Mistral(), '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"location": "Paris, France", '
                   '"unit": "celsius"}}, {"name": "get_time", "arguments": {"tz": "CET"}}]',
     "", [("get_weather", {"location": "Paris, France", "unit": "celsius"}), ("get_time", {"tz": "CET"})]),
    (tc.Mistral(True), '[TOOL_CALLS]get_weather[ARGS]{"location": "Paris, France"}[TOOL_CALLS]get_time[ARGS]{}',
     "", [("get_weather", {"location": "Paris, France"}), ("get_time", {})]),
    (tc.Mistral(True), '[TOOL_CALLS]get_time[CALL_ID]a1B2c3D4e[ARGS]{"tz": "UTC"}', "", [("get_time", {"tz": "UTC"})]),
    # the generic JSON answer
    (tc.Generic(), '{"tool_calls": [{"name": "get_weather", "arguments": {"location": "Lima"}}, '
                   '{"name": "get_time", "arguments": {}}]}',
     "", [("get_weather", {"location": "Lima"}), ("get_time", {})]),
    (tc.Generic(), '{"tool_call": {"name": "get_time", "arguments": {"tz": "UTC"}}}', "", [("get_time", {"tz": "UTC"})]),
    (tc.Generic(), '{"response": "It is \\"sunny\\"\\nin Lima \\u00e9 \\ud83d\\ude00"}', 'It is "sunny"\nin Lima é 😀', []),
    (tc.Generic(), "Plain words, no JSON.", "Plain words, no JSON.", []),
]

# Malformed calls: the text comes back as content, unchanged, and no call.
MALFORMED = [
    (tc.Hermes(), "<tool_call>\nget_weather(location='Paris')\n</tool_call>"),
    (tc.Hermes(), '<tool_call>\n{"nam": "get_weather", "arguments": {}}\n</tool_call>'),
    (tc.Hermes(), '<tool_call>\n{"name": get_weather, "arguments": {}}\n</tool_call>'),
    (tc.Hermes(), "<tool_call>"),
    (tc.QwenXml(), "<tool_call>\n<function get_weather>\n</tool_call>"),
    (tc.QwenXml(), "<tool_call>\n<function=bad\nname>\n</function>\n</tool_call>"),
    (tc.Llama3(), '{"name": 42, "parameters": {}}'),
    (tc.Llama3(), '<|python_tag|>brave_search.call(query="weather in Paris")'),
    (tc.Llama3(), '{"answer": "not a call"}'),
    (tc.Mistral(), "[TOOL_CALLS] I cannot call tools."),
    (tc.Mistral(), '[TOOL_CALLS] [{"name": "get_weather" "arguments": {}}]'),
    (tc.Mistral(True), "[TOOL_CALLS]get weather[ARGS]{}"),
    (tc.Generic(), '{"tool_calls": "get_weather"}'),
    (tc.Generic(), '{"result": 1}'),
    (tc.Generic(), '{"tool_calls": [{"name": "get_weather", "argument": {}}]}'),
]


@pytest.mark.parametrize("fmt,text,content,calls", RECORDED, ids=lambda x: getattr(x, "name", None))
def test_recorded_answers_parse(fmt, text, content, calls):
    got = calls_of(tc.parse(text, fmt, TOOLS))
    assert got == (content, calls)
    _, raw = tc.parse(text, fmt, TOOLS)
    assert len({c["id"] for c in raw}) == len(raw)                    # fresh ids
    if isinstance(fmt, tc.Mistral):
        assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in raw)   # Mistral's templates insist on 9


@pytest.mark.parametrize("fmt,text", MALFORMED, ids=lambda x: getattr(x, "name", None))
def test_malformed_calls_come_back_as_text(fmt, text):
    assert tc.parse(text, fmt, TOOLS) == (text, [])


def test_a_named_call_stays_a_call_and_what_breaks_after_it_is_text():
    """Once a call's name and its arguments' key are read the call is out (streamed); text that breaks the format
    after that ends the call and comes back as content (the same whole or streamed)."""
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris"}]\n</tool_call> trailing'
    content, calls = tc.parse(text, tc.Hermes(), TOOLS)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("get_weather", '{"location": "Paris"}')]
    assert content == "]\n</tool_call> trailing"
    cut = '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Par'        # max_tokens mid-call
    content, calls = tc.parse(cut, tc.Hermes(), TOOLS)
    assert content == "" and calls[0]["function"]["arguments"] == '{"location": "Par'


@pytest.mark.parametrize("text,content,calls", [
    ('{"tool_calls": [', "", []),
    ('{"tool_calls', "", []),
    ('{"resp', "", []),
    ('{"tool_calls": [{"name', "", []),
    ('{"tool_calls": [{"name": "get_weather", "arguments": {"location": "Lima"}}, {"name": "get_', "",
     [("get_weather", '{"location": "Lima"}')]),
    ('{"tool_calls": [{"name": "get_weather", "arguments": {"location": "Lima"}}, ', "",
     [("get_weather", '{"location": "Lima"}')]),
    ('{"tool_calls": [{"name": "get_weather", "arguments": {"location": "Li', "",
     [("get_weather", '{"location": "Li')]),
    ('{"tool_call": {"na', "", []),
    ('{"response": "It is sun', "It is sun", []),
    ('{"answer": "Li', '{"answer": "Li', []),                  # not a call list: content, cut or not
])
def test_a_generic_answer_cut_off_ends_with_its_last_named_call(text, content, calls):
    """An answer cut off by max_tokens inside its generic list of calls or its header (finish(cut=True)) ends with
    the calls it named, the unnamed rest dropped: the rest was content (', {"name": "get_' beside a finished call),
    the same fed whole or in pieces."""
    for pieces in ([text], list(text)):
        p = tc.Generic().parser(TOOLS)
        events = [e for piece in pieces for e in p.feed(piece)] + p.finish(cut=True)
        got_content, got_calls = tc.assemble(events)
        assert got_content == content
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in got_calls] == calls


def test_an_answer_not_cut_keeps_what_breaks_the_format_as_content():
    text = '{"tool_calls": [{"name": "get_weather", "arguments": {"location": "Lima"}}, {"name": "get_'
    content, calls = tc.parse(text, tc.Generic(), TOOLS)
    assert content == ', {"name": "get_' and len(calls) == 1


def _cut(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts})
    return [text[a:b] for a, b in zip([0] + points, points + [len(text)])]


def _fed(fmt, pieces):
    p = fmt.parser(TOOLS)
    events = []
    for piece in pieces:
        events += p.feed(piece)
    events += p.finish()
    content, calls = tc.assemble(events)
    return content, [(c["function"]["name"], c["function"]["arguments"]) for c in calls], events


ALL = [(f, t) for f, t, _, _ in RECORDED] + MALFORMED


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(ALL), cuts=st.lists(st.integers(0, 10_000), max_size=12))
def test_streamed_parse_equals_whole_parse(case, cuts):
    """However the answer is cut into pieces, the events assemble to what the whole text gives, and each call is
    named before any of its arguments."""
    fmt, text = case
    whole = _fed(fmt, [text])
    streamed = _fed(fmt, _cut(text, cuts))
    assert streamed[:2] == whole[:2]
    named = set()
    for e in streamed[2]:
        if e.kind == "call":
            named.add(e.index)
        elif e.kind == "args":
            assert e.index in named


def test_streamed_arguments_arrive_as_they_are_written():
    """Arguments of a well-formed call stream in fragments as the text arrives (not at the end of the call)."""
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"location": "San Francisco, CA, USA"}}\n</tool_call>'
    p = tc.Hermes().parser(TOOLS)
    seen = []
    for i in range(len(text)):
        for e in p.feed(text[i]):
            seen.append((i, e))
    calls = [(i, e) for i, e in seen if e.kind == "call"]
    args = [(i, e) for i, e in seen if e.kind == "args"]
    assert len(calls) == 1 and len(args) > 5
    assert calls[0][0] <= text.index("{\"location")              # named once the arguments start
    assert "".join(e.text for _, e in args) == '{"location": "San Francisco, CA, USA"}'


@settings(max_examples=200, deadline=None)
@given(text=st.lists(st.sampled_from(list('<>{}[]":,;/ \n\\abcnm_=') + [
    "<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", '"name"', '"arguments"', "<function=", "<parameter=",
    "</parameter>", "</function>", "<|python_tag|>", '"tool_calls"', '"response"', '"get_time"']),
    max_size=40).map("".join),
       fam=st.sampled_from([tc.Hermes(), tc.QwenXml(), tc.Llama3(), tc.Mistral(), tc.Mistral(True), tc.Generic()]),
       cuts=st.lists(st.integers(0, 200), max_size=6))
def test_any_text_parses_without_error_the_same_cut_or_whole(text, fam, cuts):
    whole = _fed(fam, [text])
    assert _fed(fam, _cut(text, cuts))[:2] == whole[:2]
    content, calls, _ = whole
    if not calls:
        assert content == text                                   # nothing lost, nothing invented


# ------------------------------------------------------------------------------------------ detection
@pytest.mark.parametrize("snippet,family", [
    ("{%- for tool in tools %}{{ tool | tojson }}{% endfor %}<tool_call>\n{\"name\": ", "hermes"),
    ("<tool_call>\n<function={{ tool_call.name }}>\n<parameter=", "qwen_xml"),
    ("{{- '<|start_header_id|>assistant<|end_header_id|>' }}{%- if tools %}{{ '<|python_tag|>' }}", "llama3"),
    ("{{ '[AVAILABLE_TOOLS]' }}{{ '[TOOL_CALLS]' }}{{ tool_calls | tojson }}", "mistral"),
    ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']}}{% endfor %}",
     "generic"),
    (None, "generic"),
])
def test_family_from_template(snippet, family):
    assert tc.detect(snippet).name == family
    assert tc.detect("[TOOL_CALLS]{{ name }}[ARGS]{{ args }}").args_form


def test_template_messages():
    msgs = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    native = tc.template_messages(msgs, tc.Hermes())
    # as the client gave them: the chat template takes them as a string or an object as it reads them
    assert native[1]["tool_calls"][0]["function"]["arguments"] == '{"tz": "UTC"}'
    none = [dict(msgs[1], tool_calls=[{"type": "function", "function": {"name": "get_time", "arguments": None}}])]
    assert tc.template_messages(none, tc.Hermes())[0]["tool_calls"][0]["function"]["arguments"] == {}
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == '{"tz": "UTC"}'       # the request is unchanged
    gen = tc.template_messages(msgs, tc.Generic(), renders_tool_role=False)
    assert json.loads(gen[1]["content"]) == {"tool_calls": [{"name": "get_time", "arguments": {"tz": "UTC"}}]}
    assert "tool_calls" not in gen[1]
    assert gen[2]["role"] == "user" and json.loads(gen[2]["content"]) == {
        "tool_response": {"tool": None, "content": "12:00", "id": "call_1"}}
    assert tc.template_messages(msgs, tc.Generic(), renders_tool_role=True)[2]["role"] == "tool"
    # the generic answer re-rendered is what the model wrote, so the next turn's prompt matches the generated tokens
    said = tc.parse(gen[1]["content"], tc.Generic())
    assert calls_of(said) == ("", [("get_time", {"tz": "UTC"})])


def test_xml_values_follow_the_parameter_schema():
    assert tc.xml_value("\n3\n", {"type": "integer"}) == 3
    assert tc.xml_value("\n3\n", {"type": "string"}) == "3"
    assert tc.xml_value("\n3\n", None) == "3"
    assert tc.xml_value("\n[1, 2]\n", {"type": "array"}) == [1, 2]
    assert tc.xml_value("\nnot json\n", {"type": "object"}) == "not json"


# ------------------------------------------------------------------------------------------ reasoning
@pytest.mark.parametrize("opened,text,reasoning_text,content", [
    (False, "<think>\nThe user wants 2+2.\n</think>\n\n4", "\nThe user wants 2+2.\n", "\n\n4"),
    (False, "  <think>a</think>b", "a", "b"),
    (False, "No thinking here.", "", "No thinking here."),
    (False, "I <think> mid-answer", "", "I <think> mid-answer"),
    (True, "Let me think.\n</think>\n\nAnswer.", "Let me think.\n", "\n\nAnswer."),
    (True, "cut off while thinking", "cut off while thinking", ""),
    (False, "<think>never closed", "never closed", ""),
])
def test_reasoning_split(opened, text, reasoning_text, content):
    for pieces in ([text], list(text), [text[:5], text[5:9], text[9:]]):
        s = reasoning.ReasoningSplit(opened)
        out = []
        for piece in pieces:
            out += s.feed(piece)
        out += s.finish()
        assert "".join(t for c, t in out if c == "reasoning") == reasoning_text
        assert "".join(t for c, t in out if c == "content") == content


def test_prompt_opening_a_reasoning_block():
    assert reasoning.prompt_opens("<|im_start|>assistant\n<think>\n")
    assert not reasoning.prompt_opens("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert reasoning.template_thinks("{{ '<think>' }}") and not reasoning.template_thinks("plain")


# ------------------------------------------------------------------------------------------ the answer as served
def _answer(fmt, opened=False, thinks=True):
    from strata.structured.plan import ChatPlan
    plan = ChatPlan(messages=[], tools=None, template_kwargs={}, pin=None, fmt=fmt, tool_defs=TOOLS if fmt else [],
                    reasoning=thinks, thinks=thinks, think_open=opened)
    return plan.answer()


def _client_view(deltas):
    """Deltas put together as OpenAI's clients do."""
    msg = {"content": "", "reasoning_content": "", "tool_calls": {}}
    for d in deltas:
        msg["content"] += d.get("content") or ""
        msg["reasoning_content"] += d.get("reasoning_content") or ""
        for c in d.get("tool_calls") or []:
            slot = msg["tool_calls"].setdefault(c["index"], {"id": c.get("id"), "name": "", "arguments": ""})
            slot["name"] += c.get("function", {}).get("name") or ""
            slot["arguments"] += c.get("function", {}).get("arguments") or ""
    return msg


ANSWERS = [
    (tc.Hermes(), False, "<think>\nThe user wants the weather.\n</think>\n\nChecking.\n<tool_call>\n"
                         '{"name": "get_weather", "arguments": {"location": "Oslo"}}\n</tool_call>',
     "Checking.", "The user wants the weather.", [("get_weather", {"location": "Oslo"})]),
    (tc.QwenXml(), True, "Need the time.\n</think>\n\n<tool_call>\n<function=get_time>\n<parameter=tz>\nUTC\n"
                         "</parameter>\n</function>\n</tool_call>",
     None, "Need the time.", [("get_time", {"tz": "UTC"})]),
    (None, True, "Short thought.</think>  The answer is 4.  ", "The answer is 4.", "Short thought.", []),
]


@pytest.mark.parametrize("fmt,opened,text,content,reasoning_text,calls", ANSWERS)
@settings(max_examples=25, deadline=None)
@given(cuts=st.lists(st.integers(0, 10_000), max_size=10))
def test_served_answer_streamed_equals_whole(fmt, opened, text, content, reasoning_text, calls, cuts):
    """The message of a non-streamed answer and the deltas of a streamed one (any cut) say the same: content and
    reasoning_content without the whitespace around them, calls named first, finish_reason tool_calls."""
    whole = _answer(fmt, opened)
    whole.feed(text)
    whole.finish()
    msg = whole.message()
    assert msg["content"] == content
    assert msg.get("reasoning_content") == reasoning_text
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg.get("tool_calls", [])] \
        == calls
    assert whole.finish_reason("stop") == ("tool_calls" if calls else "stop")
    assert whole.finish_reason("length") == "length"
    streamed = _answer(fmt, opened)
    deltas = []
    for piece in _cut(text, cuts):
        deltas += streamed.feed(piece)
    deltas += streamed.finish()
    view = _client_view(deltas)
    assert view["content"] == (content or "") and view["reasoning_content"] == reasoning_text
    assert [(c["name"], c["arguments"]) for _, c in sorted(view["tool_calls"].items())] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls", [])]
    assert all(d for d in deltas) and not any(d.get("content") == "" for d in deltas)


def test_plain_answers_pass_through_untouched():
    a = _answer(None, thinks=False)
    assert a.feed("  Hello ") == [{"content": "  Hello "}] and a.feed("") == [] and a.finish() == []
    assert a.message() == {"role": "assistant", "content": "  Hello "}


_HERMES = ('<tool_call>\n{"name": "get_weather", "arguments": {"location": "Lima"}}\n</tool_call>\n<tool_call>\n'
           '{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>')
_LLAMA3 = '{"name": "get_weather", "parameters": {"location": "Lima"}}; {"name": "get_time", "parameters": {"zone": "UTC"}}'


@pytest.mark.parametrize("fmt, text", [(tc.Hermes(), _HERMES), (tc.Hermes(), "Let me look. " + _HERMES),
                                       (tc.Llama3(), _LLAMA3), (tc.Llama3(), "<|python_tag|>" + _LLAMA3)])
def test_hermes_and_llama3_answers_cut_anywhere_leak_no_call_text(fmt, text):
    """An answer of calls cut off by max_tokens at every length (finish(cut=True)), fed whole or a character at a
    time: the content is only the text before the first call (no '<tool_call>\\n{"na', no '{"name": "get_', no
    marker's first characters), each call named so far keeps its name and its arguments are a prefix of the whole
    answer's."""
    lead = text[:text.index("<tool_call>")] if "<tool_call>" in text else ""
    _, whole = tc.parse(text, fmt, TOOLS)
    assert [c["function"]["name"] for c in whole] == ["get_weather", "get_time"]
    for n in range(len(text) + 1):
        for pieces in ([text[:n]], list(text[:n])):
            p = fmt.parser(TOOLS)
            content, calls = tc.assemble([e for piece in pieces for e in p.feed(piece)] + p.finish(cut=True))
            assert lead.strip().startswith(content.strip()), (n, content)       # blanks between calls aside
            assert len(calls) <= 2
            for got, want in zip(calls, whole):
                assert got["function"]["name"] == want["function"]["name"], (n, calls)
                assert want["function"]["arguments"].startswith(got["function"]["arguments"]), (n, calls)


@pytest.mark.parametrize("fmt, text, content, names", [
    (tc.Hermes(), 'The answer is 4 <tool_c', "The answer is 4 ", []),
    (tc.Hermes(), '<tool_call>\n{"name": "get_weather", "arguments": {"loc', "", ["get_weather"]),
    (tc.Hermes(), '<tool_call>\n{"arguments": {"location": "Lima"}, "name": "get_w', "", []),
    (tc.Llama3(), '{"answer": "Li', '{"answer": "Li', []),           # not a call object: content, cut or not
    (tc.Llama3(), '{"nam', "", []),
    (tc.Llama3(), '{"name": "get_weather", "parameters": {"location": "Lima"}}; {"name": "get_', "",
     ["get_weather"]),
    (tc.Llama3(), '<|python_tag|>', "", []),
])
def test_a_cut_call_block_is_dropped_and_text_that_is_no_call_stays(fmt, text, content, names):
    """The cut rule of each format: a call block left before its name is dropped, a named call stays; text that
    cannot be a call (a Llama 3 object whose first key no call has) stays content. Without the cut, the unnamed
    block is text that broke the format: content."""
    p = fmt.parser(TOOLS)
    got, calls = tc.assemble(p.feed(text) + p.finish(cut=True))
    assert got == content and [c["function"]["name"] for c in calls] == names
    if not names and content != text:
        assert tc.parse(text, fmt, TOOLS)[0] == text


@pytest.mark.parametrize("text, want", [
    ('{"tz": "UTC"}', {"tz": "UTC"}),
    ('{"tz": "UTC", "n": 1', {"tz": "UTC", "n": 1}),          # cut by max_tokens: what it holds complete
    ('{"tz": "UTC", "n": [1, 2', {"tz": "UTC", "n": [1, 2]}),
    ('{"tz": "UT', {}),                                        # an unfinished string left out, as the SDK reads it
    # a complete object followed by more text (a JSON string of arguments holds one): not the front object alone
    ('{"tz": "UTC"} and then some', None), ('{"tz": "UTC"}}', None), ('{"tz": "UTC"} {"tz": "CET"}', None),
    ('{"tz": "UTC" oops}', None), ('[1, 2]', None), ('"UTC"', None), ('', None), ('tz=UTC', None),
    ('{"x": NaN}', None), ('{"x": 1e999}', None)])
def test_arguments_object_is_one_object_or_a_cut_one(text, want):
    """The object an object-taking API (Messages' tool_use input, Ollama's arguments) gets from a call's arguments:
    the object, a cut object's complete part, or None. jiter's partial mode reads a complete object followed by
    more text as the object alone: that text was dropped unseen (the Messages API gave {"tz": "UTC"} for the first
    of those; Ollama gave {} for a cut object and NaN in its body)."""
    from strata.structured.tool_calls import arguments_object
    assert arguments_object(text) == want


def test_a_string_of_arguments_holding_text_after_its_object_is_kept_as_generated():
    """A call whose arguments are a JSON string holding an object and then more text (whole, or cut by max_tokens
    inside that string): the arguments are that text as generated, on every format that takes a JSON call object,
    whole and fed one character at a time."""
    raw = '{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"} and then some"}'
    for fmt, text in [(tc.Hermes(), f"<tool_call>\n{raw}\n</tool_call>"), (tc.Llama3(), raw),
                      (tc.Mistral(), f"[TOOL_CALLS][{raw}]"), (tc.Generic(), '{"tool_calls": [' + raw + "]}")]:
        for cut, want in [(len(text), '{"tz": "UTC"} and then some'), (text.index("then") + 2, '{"tz": "UTC"} and th')]:
            for pieces in ([text[:cut]], list(text[:cut])):
                p = fmt.parser()
                events = [e for piece in pieces for e in p.feed(piece)] + p.finish(cut=cut < len(text))
                content, calls = tc.assemble(events)
                assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [("get_time", want)]
                assert not content.strip(), (fmt.name, content)


def test_qwen_xml_answers_cut_anywhere_leak_no_call_text():
    """A Qwen3-Coder (XML) answer of calls cut off by max_tokens at every length, fed whole or a character at a
    time: no content (a cut inside '<parameter=NAME' or '</function>' came back as content: '\\n<parameter=b',
    '\\n</funct'), the calls named so far in order."""
    text = ("<tool_call>\n<function=get_weather>\n<parameter=location>\nLima\n</parameter>\n<parameter=days>\n3\n"
            "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n<parameter=zone>\nUTC\n"
            "</parameter>\n</function>\n</tool_call>")
    _, whole = tc.parse(text, tc.QwenXml(), TOOLS)
    assert [c["function"]["name"] for c in whole] == ["get_weather", "get_time"]
    for n in range(len(text) + 1):
        for pieces in ([text[:n]], list(text[:n])):
            p = tc.QwenXml().parser(TOOLS)
            content, calls = tc.assemble([e for piece in pieces for e in p.feed(piece)] + p.finish(cut=True))
            assert not content.strip(), (n, content)
            assert [c["function"]["name"] for c in calls] == [c["function"]["name"] for c in whole][:len(calls)]
