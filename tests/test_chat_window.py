"""Templates whose messages read their neighbours and the state set before the loop (strata.text.chat_window): the
real Qwen3, QwQ (Qwen2.5's tool format) and Qwen3.5 templates are split, and a chat rendered from kept message
outputs equals the whole render (text, token ids, cut points, content safety) over random conversations played turn
by turn: tools, runs of tool results, system prompts, reasoning (as a field and inline), user turns that look like
tool responses, enable_thinking, edits of earlier turns, branches; a later turn renders only the messages whose
output can have changed; a look-back loop stops early only where that is provably a no-op."""
from __future__ import annotations

import json

import jinja2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from strata.text.chat_chunks import split_template
from strata.text.chat_template import ChatTemplate, _environment
from strata.text.chat_window import WindowChunks
from strata.text.window_proof import split_window
from strata.text.tokenizer import Tokenizer
from tests.helpers import full_sweeps
from tests.templates import QWEN35_TEMPLATE, QWEN3_TEMPLATE, QWEN_TEMPLATE, QWQ_TEMPLATE, same_render

TEMPLATES = {"qwen3": QWEN3_TEMPLATE, "qwq": QWQ_TEMPLATE, "qwen3.5": QWEN35_TEMPLATE, "qwen-style": QWEN_TEMPLATE}


@pytest.fixture(scope="module")
def bpe(default_model_path):
    import gguf
    r = gguf.GGUFReader(str(default_model_path))
    md = {k: f.contents() for k, f in r.fields.items() if k.startswith("tokenizer.")}
    return Tokenizer.from_gguf(md), md


ATOMS = ["hello", " world", "\n", " ", "<think>", "</think>", "<tool_response>", "</tool_response>", "<|im_end|>",
         "é", "🦙", "ok", "42", "  "]
TEXT = st.lists(st.sampled_from(ATOMS), min_size=0, max_size=5).map("".join)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]


@st.composite
def message(draw, role):
    m = {"role": role, "content": draw(TEXT)}
    if role == "assistant":
        if draw(st.booleans()):
            m["reasoning_content"] = draw(TEXT)
        if draw(st.integers(0, 3)) == 0:
            m["tool_calls"] = [{"type": "function", "function": {"name": "get_weather",
                                                                 "arguments": {"q": draw(TEXT)}}}
                               for _ in range(draw(st.integers(1, 2)))]
    return m


@st.composite
def chats(draw):
    """Requests of a conversation played turn by turn: a system prompt or none; each turn a user message (at times one
    that reads as a tool response) and an answer (reasoning, tool calls followed by one to three tool results); a
    turn may edit an earlier message, branch from an earlier request or repeat one."""
    msgs = [{"role": "system", "content": draw(TEXT)}] if draw(st.booleans()) else []
    sent = []
    for _ in range(draw(st.integers(2, 7))):
        kind = draw(st.sampled_from(["grow", "grow", "grow", "grow", "branch", "edit", "repeat"]))
        if sent and kind == "branch":
            msgs = [dict(m) for m in draw(st.sampled_from(sent))]
        elif sent and kind == "edit" and msgs:
            i = draw(st.integers(0, len(msgs) - 1))
            msgs[i] = dict(msgs[i], content=draw(TEXT))
        elif sent and kind == "repeat":
            sent.append([dict(m) for m in draw(st.sampled_from(sent))])
            continue
        user = draw(message("user"))
        if draw(st.integers(0, 5)) == 0:
            user["content"] = "<tool_response>" + user["content"] + "</tool_response>"
        msgs.append(user)
        sent.append([dict(m) for m in msgs])
        for _ in range(draw(st.integers(1, 3))):
            answer = draw(message("assistant"))
            msgs.append(answer)
            if "tool_calls" not in answer:
                break
            msgs += [draw(message("tool")) for _ in range(draw(st.integers(1, 3)))]
            if draw(st.booleans()):
                sent.append([dict(m) for m in msgs])
    return sent


def _whole(source, tk):
    t = ChatTemplate(source, tk)
    t.chunks = None                # the whole render every time
    return t


@pytest.mark.parametrize("which", sorted(TEMPLATES))
@settings(max_examples=60 if full_sweeps() else 25, deadline=None,         # make test-sweeps: 60
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sent=chats(), tools=st.booleans(), agp=st.sampled_from([True, True, False]),
       kw=st.sampled_from([{}, {"enable_thinking": False}, {"enable_thinking": True}]),
       pin=st.sampled_from([None, 0, -1]))
def test_window_render_equals_the_whole_render(bpe, which, sent, tools, agp, kw, pin):
    tk, _ = bpe
    source = TEMPLATES[which]
    kept = ChatTemplate(source, tk)
    assert isinstance(kept.chunks, WindowChunks)
    whole = _whole(source, tk)
    for msgs in sent:
        args = dict(add_generation_prompt=agp, tools=TOOLS if tools else None, pin_message=pin if msgs else None,
                    **kw)
        same_render(kept, whole, msgs, **args)
    assert kept.chunks is not None             # the first chunked answer equalled the whole render


def test_which_templates_split_by_window():
    env = _environment()
    for name, source in TEMPLATES.items():
        assert split_template(env, source) is None, name       # not message by message
        assert split_window(env, source) is not None, name
    sp = split_window(env, QWEN3_TEMPLATE)
    assert (sp.behind, sp.ahead) == (1, 1) and ("ns", "last_query_index") in sp.compared
    assert split_window(env, QWEN35_TEMPLATE).threaded == {"image_count", "video_count"}
    body = "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    refused = {
        "length": "{% for m in messages %}{{ messages|length }}" + body + "{% endfor %}",
        "loop length": "{% for m in messages %}{{ loop.length }}" + body + "{% endfor %}",
        "last message": "{% for m in messages %}{{ messages[-1].role }}" + body + "{% endfor %}",
        "computed index": "{% for m in messages %}{{ messages[loop.index0 * 2].role }}" + body + "{% endfor %}",
        "index of a nested loop": "{% for m in messages %}{% for x in [1] %}{{ messages[loop.index0 + 1].role }}"
                                  "{% endfor %}" + body + "{% endfor %}",
        "generation prompt": "{% for m in messages %}{% if add_generation_prompt %}!{% endif %}" + body + "{% endfor %}",
        "time": "{% for m in messages %}{{ strftime_now('%S') }}" + body + "{% endfor %}",
        "set after": "{% for m in messages %}{{ x }}" + body + "{% endfor %}{% set x = 1 %}",
        "namespace read after": "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
                                + body + "{% endfor %}{{ ns.n }}",
        "two loops": "{% for m in messages %}" + body + "{% endfor %}{% for m in messages %}" + body + "{% endfor %}",
        "bare loop": "{% for m in messages %}{{ loop }}" + body + "{% endfor %}",
    }
    for name, source in refused.items():
        assert split_window(env, source) is None, name


# a body that reads two messages back and one ahead, a namespace it counts in (threaded), a state value read whole
# (not only compared), a compared bool (its value is a dependency) and a compared int (the comparison's outcome is)
WIDE = """{%- set ns = namespace(last=-1, n=0) %}{%- set mark = messages|length > 3 %}
{%- set fl = namespace(big=messages|length > 4, at=messages|length // 2) %}
{%- for m in messages[::-1] %}{%- set i = messages|length - 1 - loop.index0 %}
{%- if ns.last == -1 and m.role == 'user' %}{%- set ns.last = i %}{%- endif %}{%- endfor %}
{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.n = ns.n + 1 %}{%- endif %}
<{{ m.role }} {{ ns.n }}{% if loop.index0 >= 2 and messages[loop.index0 - 2].role == m.role %} again{% endif %}
{%- if not loop.last and messages[loop.index0 + 1].role == 'tool' %} calls{% endif %}
{%- if loop.index0 >= ns.last %} {{ mark }}{% endif %}{% if fl.big == true %}!{% endif %}
{%- if loop.index0 < fl.at %}<{% endif %}>{{ m.content }}
{% endfor %}"""


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sent=chats())
def test_a_wide_window_threaded_namespace_and_exact_state(bpe, sent):
    tk, _ = bpe
    sp = split_window(_environment(), WIDE)
    assert (sp.behind, sp.ahead, sp.wraps, sp.threaded) == (2, 1, 2, {"ns"})
    assert sp.compared == {("fl", "big"), ("fl", "at")} and ("mark", None) in sp.exact
    kept, whole = ChatTemplate(WIDE, tk), _whole(WIDE, tk)
    for msgs in sent:
        ref = whole.render(msgs, add_generation_prompt=False)
        got = kept.render(msgs, add_generation_prompt=False)
        assert (got.text, got.tokens, got.cut_points) == (ref.text, ref.tokens, ref.cut_points)
    assert kept.chunks is not None


def _chat(turns: int) -> list[dict]:
    msgs = [{"role": "system", "content": "You are terse."}]
    for i in range(turns):
        msgs += [{"role": "user", "content": f"Question {i}?"},
                 {"role": "assistant", "content": "", "tool_calls": [
                     {"type": "function", "function": {"name": "get_weather", "arguments": {"q": f"q{i}"}}}]},
                 {"role": "tool", "content": f"sunny {i}"}, {"role": "tool", "content": f"windy {i}"},
                 {"role": "assistant", "content": f"Answer {i}.", "reasoning_content": f"thinking {i}"}]
    return msgs


@pytest.mark.parametrize("which", ["qwen3", "qwen3.5", "qwq"])
def test_a_later_turn_renders_only_what_can_have_changed(bpe, which):
    tk, _ = bpe
    source = TEMPLATES[which]
    t = ChatTemplate(source, tk)
    msgs = _chat(20) + [{"role": "user", "content": "And now?"}]
    t.render(msgs, tools=TOOLS)
    before = dict(t.chunks.stats)
    msgs = msgs + [{"role": "assistant", "content": "Done.", "reasoning_content": "easy"},
                   {"role": "user", "content": "Thanks."}]
    got = t.render(msgs, tools=TOOLS)
    assert got.tokens == _whole(source, tk).render(msgs, tools=TOOLS).tokens
    assert got.cut_points == _whole(source, tk).render(msgs, tools=TOOLS).cut_points
    # the first message where the body reads messages[loop.index0 - 1] (the last one, there), the message before
    # the new ones (it reads its successor), the two new ones
    wraps = t.chunks.split.wraps
    assert wraps == (0 if which == "qwen3.5" else 1)          # loop.previtem is undefined at the first
    assert t.chunks.stats["rendered"] - before["rendered"] == wraps + 3
    assert t.chunks.stats["prefix_renders"] - before["prefix_renders"] <= 3
    # an earlier message edited: the first, and from the one before it (which reads it) on
    edited = [dict(m) for m in msgs]
    edited[50] = dict(edited[50], content="Changed.")
    before = dict(t.chunks.stats)
    assert t.render(edited, tools=TOOLS).tokens == _whole(source, tk).render(edited, tools=TOOLS).tokens
    assert t.chunks.stats["rendered"] - before["rendered"] == wraps + len(edited) - 49


def test_the_look_back_stops_once_its_flag_is_cleared():
    """The outer template's look-back loop gets a break after its flag is cleared; one whose later iterations could
    still do something (output, a write the flag does not guard, an expression that may raise) keeps running."""
    from strata.text.window_proof import _stop_when_cleared
    env = _environment()

    def loop_of(src):
        return next(n for n in env.parse(src).body if isinstance(n, jinja2.nodes.For))

    head = "{%- set ns = namespace(f=true, i=0) %}"
    assert _stop_when_cleared(loop_of(head + "{%- for m in messages[::-1] %}{%- set j = messages|length - loop.index0"
                                      " %}{%- if ns.f and m.role == 'user' %}{%- set ns.f = false %}{%- set ns.i = j"
                                      " %}{%- endif %}{%- endfor %}")) is not None
    for body in ("x{%- if ns.f %}{%- set ns.f = false %}{%- endif %}",                    # output every iteration
                 "{%- if m.role == 'user' %}{%- set ns.f = false %}{%- endif %}",         # not guarded by the flag
                 "{%- set j = m.content.strip() %}{%- if ns.f %}{%- set ns.f = false %}{%- endif %}",   # may raise
                 "{%- if ns.f %}{%- set ns.f = false %}{%- else %}{%- set ns.i = 1 %}{%- endif %}"):      # an else
        assert _stop_when_cleared(loop_of(head + "{%- for m in messages %}" + body + "{%- endfor %}")) is None, body


def test_a_wrong_window_split_is_caught_by_the_first_check(bpe):
    """A split of another template, put in by hand: the first answer differs from the whole render, the chunks turn
    off and the answer is the whole render's."""
    from strata.text.chat_template import _prepare_message
    tk, _ = bpe
    t = ChatTemplate(QWEN3_TEMPLATE, tk)
    t.chunks = WindowChunks(split_window(_environment(), QWQ_TEMPLATE), _prepare_message, t._substitute)
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "?"}]
    got = t.render(msgs)
    assert t.chunks is None
    assert got.tokens == _whole(QWEN3_TEMPLATE, tk).render(msgs).tokens


def test_a_comparison_box_holds_exactly_the_values_that_compare_alike():
    """A record's box (the traced values under which its comparisons come out as they did) against every value."""
    import operator

    from strata.text.chat_window import _box, _inside
    ops = {"lt": operator.lt, "le": operator.le, "gt": operator.gt, "ge": operator.ge, "eq": operator.eq,
           "ne": operator.ne}
    for op, f in ops.items():
        for other in (-1, 0, 3, 2.5):
            for value in range(-3, 7):
                guards = [(("ns", "x"), op, other, f(value, other))]
                box = _box(guards, {"ns": {"x": value}})
                for v in range(-5, 9):
                    assert _inside(box, {"ns": {"x": v}}) == (f(v, other) == f(value, other) and (
                        op not in ("eq", "ne") or f(value, other) == (op == "eq") or
                        (v > other) == (value > other))), (op, other, value, v)


# contents as agents send them back: text with whitespace at either end (shell output ends in a newline, answers
# start with blank lines), inline reasoning, user turns that read as tool responses, control-token text
WORDS = ["ok", "make test", "all passed", "é", "<|im_end|>", "<tool_call>", "x = 1"]
EDGE = st.sampled_from(["", "", "\n", "\n\n", " ", "  \n", "\t"])
BODY = st.lists(st.sampled_from(WORDS), min_size=1, max_size=3).map(" ".join)


@st.composite
def agent_text(draw):
    return draw(EDGE) + draw(BODY) + draw(st.sampled_from(["", "\n", "\n\n", "\n\n"])) + draw(BODY) + draw(EDGE)


@st.composite
def agent_chats(draw, parts: bool):
    """A conversation played turn by turn as an agent drives it: a question (at times as a list of text parts, or
    reading as a tool response); answers that call a tool (no content, or text; reasoning as a field, inline
    <think> or none) followed by tool results; a final answer."""
    def content():
        text = draw(agent_text())
        if parts and draw(st.integers(0, 2)) == 0:
            cut = draw(st.integers(0, len(text)))
            return [{"type": "text", "text": text[:cut]}, {"type": "text", "text": text[cut:]}]
        return text

    def answer(calls: bool):
        m = {"role": "assistant", "content": "" if calls and draw(st.booleans()) else draw(agent_text())}
        how = draw(st.sampled_from(["field", "inline", "none"]))
        if how == "field":
            m["reasoning_content"] = draw(agent_text())
        elif how == "inline":
            m["content"] = draw(st.sampled_from(["<think>", "", "\n<think>\n"])) + draw(agent_text()) + \
                draw(st.sampled_from(["</think>", "\n</think>\n\n"])) + m["content"]
        if calls:         # arguments an object (its keys and the strings inside client text) or a JSON string
            args = {"cmd": draw(agent_text()), "n": draw(st.integers(0, 3))}
            if draw(st.booleans()):
                args[draw(agent_text()) or "k"] = [draw(agent_text()), {"path": draw(agent_text()),
                                                                        "deep": [True, None, 1.5]}]
            if draw(st.booleans()):
                args = json.dumps(args, ensure_ascii=draw(st.booleans()))
            m["tool_calls"] = [{"type": "function", "function": {"name": "run_shell", "arguments": args}}]
        return m

    msgs = [{"role": "system", "content": draw(agent_text())}] if draw(st.booleans()) else []
    sent = []
    for _ in range(draw(st.integers(2, 4))):
        user = {"role": "user", "content": content()}
        if sent and draw(st.integers(0, 4)) == 0:       # the first question is a real one (Qwen3.5 needs one)
            user["content"] = "<tool_response>\n" + draw(BODY) + "\n</tool_response>"
        msgs.append(user)
        sent.append([dict(m) for m in msgs])
        for _ in range(draw(st.integers(0, 2))):
            msgs.append(answer(True))
            msgs += [{"role": "tool", "content": draw(agent_text())} for _ in range(draw(st.integers(1, 2)))]
            if draw(st.booleans()):
                sent.append([dict(m) for m in msgs])
        msgs.append(answer(False))
    return sent


@pytest.mark.parametrize("which", ["qwen3", "qwen3.5", "qwq"])
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_agent_chats_with_rewritten_contents_render_only_what_changed(bpe, which, data):
    """Contents the templates trim or cut (edge whitespace, inline <think>, multi-part lists for Qwen3.5, whose
    content macro joins them) and tool-call arguments they print through tojson take the kept path: no fallback,
    and the same text, ids, cut points as the whole render, every content tokenized as plain text."""
    tk, _ = bpe
    source = TEMPLATES[which]
    sent = data.draw(agent_chats(parts=which == "qwen3.5"))
    kept, whole = ChatTemplate(source, tk), _whole(source, tk)
    for msgs in sent:
        assert same_render(kept, whole, msgs, tools=TOOLS)
        assert kept.render(msgs, tools=TOOLS).content_safe
    assert kept.chunks is not None and kept.chunks.stats["fallbacks"] == 0
    assert kept.chunks.stats["calls"] == 2 * len(sent)


def _small_agent_chat() -> list[dict]:
    return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Run it."},
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"q": "ls"}}}]},
            {"role": "tool", "content": "a b"}, {"role": "assistant", "content": "Done.", "reasoning_content": "ok"},
            {"role": "user", "content": "More?"}, {"role": "assistant", "content": "Yes."}]


# each construct that made a real template's kept path fall back before contents were shaped (the templates it did:
# 3 Qwen3, q QwQ, 5 Qwen3.5)
CONSTRUCTS = {
    "system prompt ends in a space (5)": lambda m: m[0].update(content="Be brief. "),
    "question ends in a newline (5)": lambda m: m[1].update(content="Run it.\n"),
    "tool result ends in a newline (5)": lambda m: m[3].update(content="a b\n"),
    "answer starts with blank lines (3 5)": lambda m: m[6].update(content="\n\nYes."),
    "reasoning with edge newlines (3 5)": lambda m: m[6].update(reasoning_content="\nthink\n"),
    "inline reasoning in an earlier answer (3 q)": lambda m: m.__setitem__(
        4, {"role": "assistant", "content": "<think>\nok\n</think>\n\nDone."}),
    "inline reasoning in the last answer (3 5)": lambda m: m[6].update(content="<think>\nok\n</think>\n\nYes."),
    "a question that reads as a tool response (3 5)": lambda m: m[5].update(
        content="<tool_response>\nx\n</tool_response>"),
    "arguments a JSON string (q)": lambda m: m[2]["tool_calls"][0]["function"].update(arguments='{"q": "ls -l"}'),
    "arguments with a quote and a newline (3 q)": lambda m: m[2]["tool_calls"][0]["function"].update(
        arguments={"q": 'echo "a"\nls'}),
}


@pytest.mark.parametrize("which", ["qwen3", "qwen3.5", "qwq"])
def test_each_rewritten_construct_takes_the_kept_path(bpe, which):
    tk, _ = bpe
    source = TEMPLATES[which]
    for name, change in CONSTRUCTS.items():
        msgs = _small_agent_chat()
        change(msgs)
        kept, whole = ChatTemplate(source, tk), _whole(source, tk)
        assert same_render(kept, whole, msgs, tools=TOOLS), name
        assert kept.chunks is not None and kept.chunks.stats["fallbacks"] == 0, name
        assert whole.render(msgs, tools=TOOLS).content_safe, name
