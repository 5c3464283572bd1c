"""Tool-call arguments as each chat template reads them: a template that needs them as an object (Qwen3.5's `|items`,
QwQ's `tojson`) gets the JSON string a client sent parsed, one with a string branch (Qwen3's `is string`) gets it
verbatim; checked against transformers' apply_chat_template of the same messages (arguments parsed where the
template needs an object), through ChatTemplate and through the daemon with the openai client."""
from __future__ import annotations

import copy
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strata.text.chat_template import ChatTemplate, TemplateRefusal, json_object
from strata.text.tokenizer import Tokenizer
from tests.templates import QWEN3_TEMPLATE, QWEN35_TEMPLATE, QWQ_TEMPLATE

TEMPLATES = {"qwen3": QWEN3_TEMPLATE, "qwen3.5": QWEN35_TEMPLATE, "qwq": QWQ_TEMPLATE}
ARGS = {"city": "Paris Île", "days": 3, "opts": {"unit": "celsius", "tags": ["a b", None, True, 1.5]}}
FIELD = "messages[1].tool_calls[0].function.arguments"


def _chat(arguments) -> list[dict]:
    return [{"role": "user", "content": "What will the weather be in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]


def _parsed(msgs: list[dict]) -> list[dict]:
    out = copy.deepcopy(msgs)
    for m in out:
        for c in m.get("tool_calls") or []:
            c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    return out


@pytest.fixture(scope="module")
def tk(default_model_path):
    import gguf
    r = gguf.GGUFReader(str(default_model_path))
    return Tokenizer.from_gguf({k: f.contents() for k, f in r.fields.items() if k.startswith("tokenizer.")})


def _reference(hf_tokenizer, source, msgs, tokenize=False):
    out = hf_tokenizer.apply_chat_template(msgs, chat_template=source, tokenize=tokenize, add_generation_prompt=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out) if tokenize else out


@pytest.mark.parametrize("which,needs", [("qwen3", False), ("qwen3.5", True), ("qwq", True)])
def test_the_probe_finds_which_templates_read_arguments_as_an_object(tk, which, needs):
    assert ChatTemplate(TEMPLATES[which], tk).object_arguments is needs


def test_the_probe_passes_a_template_that_checks_call_ids(tk):
    """A template in the manner of Mistral's (call ids of 9 characters or raise_exception; the function printed
    with tojson) reads arguments as an object."""
    source = ("{%- for m in messages %}{%- if m.role == 'user' %}[INST] {{ m.content }}[/INST]"
              "{%- elif m.tool_calls %}[TOOL_CALLS] [{%- for tc in m.tool_calls %}{%- if tc.id|length != 9 %}"
              "{{ raise_exception('call ids have 9 characters') }}{%- endif %}{{ tc.function|tojson }}{%- endfor %}]"
              "{%- endif %}{%- endfor %}")
    t = ChatTemplate(source, tk)
    assert t.object_arguments
    msgs = _chat(json.dumps(ARGS))
    msgs[1]["tool_calls"][0]["id"] = "abcdefghi"
    assert '"arguments": ' + json.dumps(ARGS, ensure_ascii=False) in t.render(msgs).text


@pytest.mark.parametrize("which", ["qwen3.5", "qwq"])
@pytest.mark.parametrize("compact", [False, True])
def test_string_arguments_reach_an_object_template_parsed(tk, hf_tokenizer, which, compact):
    """The JSON string renders as transformers renders the parsed object (Qwen3.5 cannot render the string at
    all), with the same ids, on the kept path and the whole render alike."""
    sep = (",", ":") if compact else None
    msgs = _chat(json.dumps(ARGS, ensure_ascii=compact, separators=sep))
    ref = _reference(hf_tokenizer, TEMPLATES[which], _parsed(msgs))
    ref_ids = _reference(hf_tokenizer, TEMPLATES[which], _parsed(msgs), tokenize=True)
    kept, whole = ChatTemplate(TEMPLATES[which], tk), ChatTemplate(TEMPLATES[which], tk)
    whole.chunks = None
    for t in (kept, whole, kept):            # the kept path twice: the second render reuses kept messages
        got = t.render(msgs)
        assert got.text == ref and got.tokens == ref_ids and got.content_safe
    assert kept.chunks is not None and kept.chunks.stats["fallbacks"] == 0
    assert kept.render_text(msgs) == ref
    assert msgs[1]["tool_calls"][0]["function"]["arguments"].startswith("{")      # the caller's messages unchanged


def test_a_string_branch_template_keeps_the_client_string_byte_for_byte(tk, hf_tokenizer):
    """Qwen3 prints a string as it is and an object through tojson: both as transformers does."""
    t = ChatTemplate(QWEN3_TEMPLATE, tk)
    for args in ('{"city":"Paris",  "days":3}', "city=Paris", ARGS):
        msgs = _chat(args)
        got = t.render(msgs)
        assert got.text == _reference(hf_tokenizer, QWEN3_TEMPLATE, msgs)
        if isinstance(args, str):
            assert f'"arguments": {args}}}' in got.text


def test_keys_and_strings_inside_the_object_stay_plain_text(tk):
    """Qwen3.5 prints each key raw: a key or value holding <|im_end|> stays text, as a content does."""
    end = tk.tokens.index("<|im_end|>")
    msgs = _chat(json.dumps({" q<|im_end|>\n": ["<|im_end|>", {"b": "c "}]}))
    kept, whole = ChatTemplate(QWEN35_TEMPLATE, tk), ChatTemplate(QWEN35_TEMPLATE, tk)
    whole.chunks = None
    got, ref = kept.render(msgs), whole.render(msgs)
    assert "<parameter= q<|im_end|>\n>" in got.text and got.content_safe
    assert (got.text, got.tokens, got.cut_points) == (ref.text, ref.tokens, ref.cut_points)
    assert got.tokens.count(end) == got.text.count("<|im_end|>") - 2


@pytest.mark.parametrize("which", ["qwen3", "qwen3.5", "qwq"])
def test_the_chat_routes_plan_hands_arguments_to_the_template_as_the_client_sent_them(tk, hf_tokenizer, which):
    """The chat route's plan (strata.structured.plan) of a request with a past call, rendered: a string-branch
    template's prompt holds the client's string byte for byte (compact, as a model may write it), an object
    template's is transformers' render of the parsed object."""
    from types import SimpleNamespace

    from strata.serve.schema import parse_chat
    from strata.structured.plan import plan_chat
    args = json.dumps(ARGS, separators=(",", ":"), ensure_ascii=False)
    t = ChatTemplate(TEMPLATES[which], tk)
    msgs = _chat(args)
    plan = plan_chat(SimpleNamespace(template=t, tokenizer=tk), parse_chat({"model": "m", "messages": msgs}))
    got = t.render(plan.messages).text
    assert got == _reference(hf_tokenizer, TEMPLATES[which], msgs if which == "qwen3" else _parsed(msgs))
    assert (f'"arguments": {args}}}' in got) is (which == "qwen3")


@pytest.mark.parametrize("bad", ["[1, 2]", "city=Paris", '"Paris"', '{"a": NaN}', "{'a': 1}"])
def test_arguments_no_object_template_can_read_are_refused_naming_the_field(tk, bad):
    """A string that is no JSON object stays as the client sent it (llama.cpp hands valid JSON of another kind
    parsed); Qwen3.5 cannot read it: a TemplateRefusal naming the call's arguments. Qwen3 prints it."""
    t = ChatTemplate(QWEN35_TEMPLATE, tk)
    for _ in range(2):                      # the kept path's answer is the same
        with pytest.raises(TemplateRefusal) as e:
            t.render(_chat(bad))
        assert e.value.param == FIELD and str(e.value).startswith(FIELD)
    with pytest.raises(TemplateRefusal) as e:
        t.render_text(_chat(bad))
    assert e.value.param == FIELD
    assert bad in ChatTemplate(QWEN3_TEMPLATE, tk).render(_chat(bad)).text
    assert "<parameter=city>" in t.render(_chat(json.dumps(ARGS))).text       # the template still renders


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory, synthetic):
    """`strata serve` on a tiny synthetic qwen35 model with the real Qwen3.5 chat template."""
    from tests.daemon import Daemon, free_port
    path = synthetic("qwen35", name="qwen35-template", overrides={"tokenizer.chat_template": QWEN35_TEMPLATE})
    d = Daemon(tmp_path_factory.mktemp("qwen35"), "--model", str(path), port=free_port(), n_ctx=2048).start()
    yield d
    assert d.stop() == 0, d.log_tail()


def test_the_daemon_answers_a_chat_with_a_past_call_to_a_qwen35_template(qwen35, hf_tokenizer):
    """The openai client's chat (arguments the JSON string it sends) is answered; the prompt is transformers'
    render of the parsed messages, its length that render's tokens; bad arguments are a 400 naming the field that
    changes nothing."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{qwen35.port}/v1", api_key="unused", max_retries=0,
                           timeout=120)
    msgs = _chat(json.dumps(ARGS, ensure_ascii=False))
    ref = _reference(hf_tokenizer, QWEN35_TEMPLATE, _parsed(msgs))
    ref_ids = _reference(hf_tokenizer, QWEN35_TEMPLATE, _parsed(msgs), tokenize=True)
    r = client.chat.completions.create(model="default", messages=msgs, max_tokens=2, temperature=0)
    assert r.usage.prompt_tokens == len(ref_ids)
    st, body = qwen35.json("POST", "/apply-template", {"messages": msgs})
    assert st == 200 and body["prompt"] == ref
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="default", messages=_chat("city=Paris"), max_tokens=2)
    assert e.value.status_code == 400 and e.value.body["param"] == FIELD
    again = client.chat.completions.create(model="default", messages=msgs, max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens == len(ref_ids)


def test_the_responses_route_names_the_input_item_whose_arguments_are_bad(qwen35):
    """Through /v1/responses the refusal names the function_call item (after instructions, a message and another
    call's good arguments), and the same input with good arguments is answered."""
    good = json.dumps(ARGS)
    body = {"instructions": "Be brief.", "max_output_tokens": 2, "input": [
        {"role": "user", "content": "Weather?"},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": good},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": "[1, 2]"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]}
    st, r = qwen35.json("POST", "/v1/responses", body)
    assert st == 400 and r["error"]["param"] == "input[2].arguments", r
    body["input"][2]["arguments"] = good
    st, r = qwen35.json("POST", "/v1/responses", body)
    assert st == 200 and r["status"] == "incomplete", r


def _nested(inner):
    return st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3)


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) |
                    st.text(), _nested, max_leaves=8)


@settings(max_examples=400, deadline=None)
@given(obj=st.dictionaries(st.text(), JSON, max_size=4), ascii_=st.booleans(), noise=st.text(max_size=12),
       cut=st.integers(0, 1000))
def test_json_object_reads_any_string(obj, ascii_, noise, cut):
    """Arguments as a client sends them: a JSON object is read back whole (its keys in order); anything else (a cut
    object, other JSON, text) is None, never an exception."""
    s = json.dumps(obj, ensure_ascii=ascii_)
    got = json_object(s)
    assert got == obj and list(got) == list(obj)
    got = json_object(s[:cut % (len(s) + 1)] + noise)         # a cut object with noise after it: never raises
    assert got is None or type(got) is dict
    for other in (json.dumps(list(obj.values())), json.dumps(noise), noise + "]"):
        assert json_object(other) is None or not other.strip()


@pytest.mark.parametrize("depth", [65, 700])
def test_deeply_nested_arguments_are_a_400_on_every_route(qwen35, depth):
    """Arguments nested past MAX_ARGUMENT_DEPTH (as an object or as its JSON string) are refused naming the field on
    the chat, Ollama and Messages routes: never a 5xx from recursion."""
    deep = json.loads('{"a": ' + "[" * (depth - 1) + "]" * (depth - 1) + "}")
    for args in (deep, json.dumps(deep)):
        st, r = qwen35.json("POST", "/v1/chat/completions", {"max_tokens": 1, "messages": _chat(args)})
        assert st == 400 and r["error"]["param"] == FIELD, r
        st, r = qwen35.json("POST", "/api/chat", {"stream": False, "options": {"num_predict": 1},
                                                  "messages": _chat(args)})
        assert st == 400, r
    st, r = qwen35.json("POST", "/v1/messages", {"max_tokens": 1, "messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "c1", "name": "get_weather", "input": deep}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "sunny"}]}]})
    assert st == 400, r
