"""Client strings shaped for the sentinel method (strata.text.content_shape): the markers found in the real Qwen
templates; the string functions those templates apply (strip, trim, lstrip / rstrip of newlines, split on
</think> and <think>, startswith / endswith <tool_response>, `in`) give on a shaped string, its sentinels put back,
what they give on the string itself; the tokenizer condition refuses what could join client text to a special
token; and shaping changes no token id against the unshaped sentinel method where both apply."""
from __future__ import annotations

import jinja2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from strata.text.chat_template import ChatTemplate, _environment
from strata.text.content_shape import ContentShape, content_shape, string_markers
from strata.text.tokenizer import Tokenizer
from tests.templates import QWEN35_TEMPLATE, QWEN3_TEMPLATE, QWEN_TEMPLATE, QWQ_TEMPLATE

MARKERS = frozenset({"<think>", "</think>", "<tool_response>", "</tool_response>"})
ATOMS = ["hello", " world", "\n", " ", "\t", "\u00a0", "<think>", "</think>", "<tool_response>", "</tool_response>",
         "<|im_end|>", "é", "ok", "  ", "\n\n", "</", "think>", "qzx", "zqx"]
TEXT = st.lists(st.sampled_from(ATOMS), min_size=0, max_size=7).map("".join)

FUNCTIONS = {
    "strip": lambda s: s.strip(), "lstrip nl": lambda s: s.lstrip("\n"), "rstrip nl": lambda s: s.rstrip("\n"),
    "strip nl": lambda s: s.strip("\n"), "think tail": lambda s: s.split("</think>")[-1].lstrip("\n"),
    "think head": lambda s: s.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n"),
    "trim then head": lambda s: s.strip().split("</think>")[0].strip(),
    "has think": lambda s: "</think>" in s,
    "tool response": lambda s: s.startswith("<tool_response>") and s.endswith("</tool_response>"),
    "trimmed tool response": lambda s: s.strip().startswith("<tool_response>") and
    s.strip().endswith("</tool_response>"),
}


def _restore(x, table):
    if isinstance(x, str):
        for k, v in table.items():
            x = x.replace(k, v)
    return x


@settings(max_examples=400, deadline=None)
@given(s=TEXT)
def test_shaped_strings_read_alike(s):
    shape = ContentShape(MARKERS)
    table: dict[str, str] = {}

    def sent(core):
        key = f"zqxfeedbeefs{len(table)}qzx"
        table[key] = core
        return key

    shaped = shape.shape(s, sent)
    assert _restore(shaped, table) == s
    for name, f in FUNCTIONS.items():
        assert _restore(f(shaped), table) == f(s), name
    for core in table.values():          # each sentinel stands for text without edge whitespace or markers
        assert core and core == core.strip() and not any(m in core for m in MARKERS) or \
            len(table) == 1 and core == s


def test_an_unsafe_marker_stays_in_a_sentinel():
    shape = ContentShape(MARKERS, unsafe=frozenset({"<think>"}))
    assert shape.shape(" a<think>b </think>\n", lambda core: f"[{core}]") == " [a<think>b] </think>\n"
    assert ContentShape(MARKERS).shape(" a<think>b ", lambda core: f"[{core}]") == " [a]<think>[b] "
    # a sentinel text that would complete a marker: the string is one sentinel
    assert ContentShape(frozenset({"]"})).shape("a ]", lambda core: f"[{core}]") == "[a ]]"


def test_markers_of_the_real_templates():
    env = _environment()
    for source in (QWEN3_TEMPLATE, QWQ_TEMPLATE, QWEN35_TEMPLATE):
        assert string_markers(env, source) >= {"</think>"}
    assert string_markers(env, QWEN3_TEMPLATE) >= MARKERS
    assert string_markers(env, QWEN35_TEMPLATE) >= MARKERS
    # templates that read no string (a client string is in the output whole or not at all): no shaping
    assert string_markers(env, QWEN_TEMPLATE) is None
    assert string_markers(env, "{% for m in messages %}{{ m.content }}{% endfor %}") is None
    assert string_markers(env, "{% for m in messages %}{{ m.content|trim }}{% endfor %}") == frozenset()
    assert string_markers(env, "{{ x.replace('a', 'b') }}{{ y|replace('c', 'd') }}{% if 'e' in z %}{% endif %}") \
        == {"a", "c", "e"}
    assert string_markers(env, "{% if %}") is None


def test_the_tokenizer_condition():
    # (text, user_defined) of special tokens
    assert content_shape(None, []) is None
    assert content_shape(MARKERS, [("<|im_end|>", False)]).unsafe == frozenset()
    assert content_shape(MARKERS, [("\n\n", True)]) is None          # a special holding whitespace: no shaping
    assert content_shape(MARKERS, [("<|im start|>", False)]) is None
    assert content_shape(MARKERS, [("<think>", True)]).unsafe == frozenset()      # found in plain text too
    assert content_shape(MARKERS, [("<think>", False)]).unsafe == {"<think>"}     # a control marker
    assert content_shape(MARKERS, [("think>x", True)]).unsafe == {"<think>", "</think>"}     # overlaps partly
    assert content_shape(MARKERS, [("<think>!", True)]).unsafe == {"<think>"}     # holds a marker
    assert content_shape(MARKERS, [("ink", False)]).unsafe == {"<think>", "</think>"}        # control inside
    assert content_shape(MARKERS, [("ink", True)]).unsafe == frozenset()


@pytest.fixture(scope="module")
def tk(default_model_path):
    import gguf
    r = gguf.GGUFReader(str(default_model_path))
    return Tokenizer.from_gguf({k: f.contents() for k, f in r.fields.items() if k.startswith("tokenizer.")})


# a template that tests contents for markers but prints them whole: shaped and plain sentinels both split it
READS = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if '</think>' in m.content %}!{% endif %}"
         "{% if m.content.startswith('<tool_response>') %}?{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(contents=st.lists(TEXT, min_size=1, max_size=4))
def test_shaped_contents_tokenize_as_plain_text(tk, contents):
    """The render's ids are those of its text with each content a plain-text piece (built here by hand from what
    READS prints), whether the content holds markers and edge whitespace or not."""
    t = ChatTemplate(READS, tk)
    assert t._shape is not None
    t.chunks = None
    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": c} for i, c in enumerate(contents)]
    got = t.render(msgs, add_generation_prompt=False)
    pieces = []
    for m in msgs:
        c = m["content"]
        flags = ("!" if "</think>" in c else "") + ("?" if c.startswith("<tool_response>") else "")
        pieces += [(f"<|im_start|>{m['role']}\n{flags}", True), (c, False), ("<|im_end|>\n", True)]
    assert got.text == "".join(p for p, _ in pieces) and got.content_safe
    assert got.tokens == tk.encode_pieces(pieces)


def test_qwen_templates_keep_contents_plain_text(tk):
    """Contents the templates trim or cut are still tokenized as plain text: control-token text in them stays
    text (the whole render's sentinel split holds)."""
    msgs = [{"role": "system", "content": "sys\n"},
            {"role": "user", "content": " <|im_end|> hi\n"},
            {"role": "assistant", "content": "<think>\nr <|im_start|>\n</think>\n\nanswer <|im_end|>\n"},
            {"role": "user", "content": "again"}]
    end = tk.tokens.index("<|im_end|>")
    for source in (QWEN3_TEMPLATE, QWQ_TEMPLATE, QWEN35_TEMPLATE):
        t = ChatTemplate(source, tk)
        t.chunks = None
        got = t.render(msgs)
        assert got.content_safe
        # the template's own <|im_end|> tokens only (the two in the contents stay text)
        assert got.text.count("<|im_end|>") == 6 and got.tokens.count(end) == 4


def test_a_jinja_error_is_no_markers():
    assert string_markers(jinja2.Environment(), "{% for %}") is None


@pytest.mark.parametrize("ascii_", [False, True])
def test_contents_through_tojson_stay_plain_text(tk, ascii_):
    """A client string the template prints with tojson is put back JSON-escaped and tokenized as plain text (its
    <|im_end|> stays text); the tool-call arguments of QwQ's template alike (given as a JSON string, handed to it as
    the object it reads: its tojson prints the object, the strings inside escaped)."""
    t = ChatTemplate("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content|tojson(ensure_ascii=ASCII) }}"
                     "<|im_end|>\n{% endfor %}".replace("ASCII", str(ascii_)), tk)
    t.chunks = None
    c = ' é "q" <|im_end|>\n\t'
    got = t.render([{"role": "user", "content": c}], add_generation_prompt=False)
    import json
    assert got.text == f"<|im_start|>user\n{json.dumps(c, ensure_ascii=ascii_)}<|im_end|>\n" and got.content_safe
    end = tk.tokens.index("<|im_end|>")
    assert got.tokens.count(end) == 1
    args = json.dumps({"path": "a\"b\n<|im_end|>", "n": 1})
    msgs = [{"role": "user", "content": "read it"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "read_file", "arguments": args}}]},
            {"role": "tool", "content": "ok\n"}, {"role": "user", "content": "and?"}]
    t = ChatTemplate(QWQ_TEMPLATE, tk)
    got = t.render(msgs)
    whole = ChatTemplate(QWQ_TEMPLATE, tk)
    whole.chunks = None
    ref = whole.render(msgs)
    assert t.object_arguments and '"arguments": ' + json.dumps(json.loads(args), ensure_ascii=False) in got.text
    assert got.content_safe and ref.content_safe
    assert (got.text, got.tokens, got.cut_points) == (ref.text, ref.tokens, ref.cut_points)
    assert got.tokens.count(end) == got.text.count("<|im_end|>") - 1
